"""``relayd bench --rounds``: per-round ratios and the median round's cells, exactly.

The rounds exist because one method's median drifts between minutes on a shared
machine; a ratio is only as good as the pairing of its two sides, so each is
taken within one round and only then summarized.
"""

from __future__ import annotations

from relayd_bench._rounds import median_cells, round_ratios
from relayd_bench._stats import Result, Status
from relayd_bench._table import render_table
from tests.unit._bench_results import ok

K256 = 256 << 10


def _round(floor: int, sync: int, shm: int | None, async_floor: int) -> list[Result]:
    """One round's cells at 256 KiB, each sample set a single time (its median)."""
    cells = [ok("floor", K256, [floor]), ok("floor-async", K256, [async_floor])]
    cells.append(ok("relayd-sync", K256, [sync]))
    if shm is None:
        cells.append(Result("relayd-shm", K256, Status.FAILED, "daemon died"))
    else:
        cells.append(ok("relayd-shm", K256, [shm]))
    return cells


ROUNDS = [
    _round(floor=100, sync=300, shm=400, async_floor=200),
    _round(floor=200, sync=400, shm=None, async_floor=100),  # a slow minute; shm failed
    _round(floor=100, sync=500, shm=300, async_floor=100),
]


def test_each_ratio_pairs_its_two_sides_within_a_round() -> None:
    got = {(r.method, r.baseline): r for r in round_ratios(ROUNDS)}
    assert got["relayd-sync", "floor"].ratios == (3.0, 2.0, 5.0)
    assert got["relayd-sync", "floor"].median == 3.0
    assert (got["relayd-sync", "floor"].low, got["relayd-sync", "floor"].high) == (2.0, 5.0)
    # the round where relayd-shm failed gives no ratio, not a stale one
    assert got["relayd-shm", "floor"].ratios == (4.0, 3.0)
    assert got["relayd-shm", "floor"].median == 3.5
    # the async client is also held against the floor driven from an event loop
    assert got["relayd-shm", "floor-async"].ratios == (2.0, 3.0)
    assert ("floor", "floor") not in got
    assert all(r.size == K256 for r in got.values())


def test_the_table_cell_is_the_median_rounds_own_cell_and_a_copy() -> None:
    cells = {c.method: c for c in median_cells(ROUNDS)}
    assert [c.method for c in median_cells(ROUNDS)] == [c.method for c in ROUNDS[0]]
    assert cells["floor"].latency is not None and cells["floor"].latency.median_ns == 100
    assert cells["relayd-sync"].latency is not None
    assert cells["relayd-sync"].latency.median_ns == 400  # of 300, 400, 500
    # two measured rounds: the lower middle one
    assert cells["relayd-shm"].latency is not None
    assert cells["relayd-shm"].latency.median_ns == 300
    cells["relayd-sync"].ratio_vs_floor = 9.0
    assert all(c.ratio_vs_floor is None for r in ROUNDS for c in r)


def test_a_cell_measured_in_no_round_keeps_the_first_rounds_reason() -> None:
    failed = [[Result("relayd-shm", K256, Status.FAILED, f"round {k}")] for k in range(2)]
    [cell] = median_cells(failed)
    assert cell.status is Status.FAILED and cell.reason == "round 0"
    assert round_ratios(failed) == []
    assert median_cells([]) == [] and round_ratios([]) == []


def test_the_table_prints_each_ratios_median_and_range() -> None:
    text = render_table(median_cells(ROUNDS), rounds=round_ratios(ROUNDS))
    assert "ratios per round (3 rounds, both sides of each in the same round)" in text
    assert "relayd-sync / floor: x3.00 [2.00-5.00] at 256KiB" in text
    assert "relayd-shm / floor-async: x2.50 [2.00-3.00] at 256KiB" in text
    assert "ratios per round" not in render_table(median_cells(ROUNDS))


def test_modelled_latencies_are_compared_round_by_round_where_round_trips_were_counted() -> None:
    def cross(relayd: int, raw: int) -> list[Result]:
        return [
            ok("mooncake-raw", K256, [raw], extra={"rt": "1.50"}),
            ok("relayd-mooncake", K256, [relayd], extra={"rt": "0.50"}),
        ]

    rounds = [cross(relayd=800_000, raw=200_000), cross(relayd=600_000, raw=200_000)]
    got = {r.rtt_ns: r for r in round_ratios(rounds) if r.baseline == "mooncake-raw"}
    assert got[None].ratios == (4.0, 3.0)
    # at 200 us: (median + 0.5 RTT) / (median + 1.5 RTT), in each round
    assert got[200_000].ratios == (900_000 / 500_000, 700_000 / 500_000)
    assert got[200_000].median == 1.6
    assert set(got) == {None, 50_000, 200_000, 1_000_000}
    text = render_table(median_cells(rounds), rounds=round_ratios(rounds))
    assert "relayd-mooncake / mooncake-raw modelled at RTT 200us: x1.60 [1.40-1.80]" in text
    # a round that counted no round trips gives no modelled ratio
    rounds[1][1].extra.clear()
    assert [r.ratios for r in round_ratios(rounds) if r.rtt_ns == 200_000] == [(1.8,)]
