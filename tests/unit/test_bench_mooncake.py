"""relayd-mooncake against raw Mooncake in the benchmark: registry, arithmetic, output, method.

The end-to-end run (two daemons, real processes) is in tests/integration/test_bench_smoke.py.
"""

from __future__ import annotations

import json

from relayd_bench._api import BenchContext
from relayd_bench._payload import Stamp, check_tensor, make_source
from relayd_bench._registry import BASELINES, ENTRIES, PEER_REQUIRES, Entry
from relayd_bench._stats import Cpu, Result, Status, add_ratios, comparisons, to_json
from relayd_bench._table import TABLE_WIDTH, render_table
from tests._mooncake import NO_MOONCAKE, requires_mooncake
from tests.unit._bench_results import ok

KIB, MIB = 1 << 10, 1 << 20


def test_mooncake_raw_is_a_baseline_that_needs_mooncake_only() -> None:
    raw = ENTRIES["mooncake-raw"]
    assert raw in BASELINES
    assert raw.requires == ("mooncake.engine:TransferEngine",)
    assert not raw.needs_daemon and not raw.local and not raw.needs_peer_daemon


def test_relayd_mooncake_with_the_users_daemon_needs_the_users_reader_daemon() -> None:
    entry = ENTRIES["relayd-mooncake"]
    why = entry.unavailable(socket="/run/a.sock", reader_socket=None)
    assert why is not None and "--reader-socket" in why
    assert entry.unavailable(socket="/run/a.sock", reader_socket="/run/b.sock") is None
    # a user-supplied pair needs nothing of Mooncake in the bench's own process
    assert entry.unavailable(socket=None, reader_socket="/run/b.sock") is None


def test_relayd_mooncake_started_by_the_bench_needs_mooncake_here() -> None:
    fake = Entry("x", "m:C", "", needs_peer_daemon=True)
    why = fake.unavailable(socket=None, reader_socket=None)
    if NO_MOONCAKE:
        assert why is not None and "Mooncake" in why and "--reader-socket" in why
    else:
        assert why is None
    assert PEER_REQUIRES == ("mooncake.engine:TransferEngine",)


def _rows() -> list[Result]:
    rows = [
        ok("floor", 256 * KIB, [100]),
        ok("floor", MIB, [200]),
        ok("mooncake-raw", 256 * KIB, [400]),
        ok("mooncake-raw", MIB, [1_000]),
        ok("relayd-mooncake", MIB, [1_500], cpu=Cpu(10e3, 20e3, 30e3, 0, 0, 40e3, 0.25, 0.5)),
        Result("relayd-mooncake", 256 * KIB, Status.FAILED, "peer daemons unavailable"),
    ]
    add_ratios(rows)
    return rows


def test_the_in_place_read_is_held_against_raw_mooncake_like_the_copying_one() -> None:
    view, copy = ENTRIES["relayd-mooncake-view"], ENTRIES["relayd-mooncake"]
    assert (view.cross_node, view.needs_peer_daemon) == (True, True)
    assert (view.min_size, view.requires) == (copy.min_size, copy.requires)
    rows = [
        ok("mooncake-raw", MIB, [1_000]),
        ok("relayd-mooncake", MIB, [1_500]),
        ok("relayd-mooncake-view", MIB, [1_200]),
    ]
    add_ratios(rows)
    assert comparisons(rows) == [
        ("relayd-mooncake", "mooncake-raw", [(MIB, 1.5)]),
        ("relayd-mooncake-view", "mooncake-raw", [(MIB, 1.2)]),
    ]


def test_detail_tables_keep_names_that_share_a_prefix_apart() -> None:
    names = ("mooncake-raw", "relayd-mooncake", "relayd-mooncake-view", "relayd-mooncake-late")
    rows = [ok(m, MIB, [1_000], extra={"rt": "0.50"}) for m in names]
    add_ratios(rows)
    lines = render_table(rows).splitlines()
    for table in ("p99", "RT+"):  # the per-cell details, the round-trip model
        start = next(i for i, line in enumerate(lines) if table in line and "method" in line)
        words = {word for line in lines[start + 1 :][:4] for word in line.split()}
        assert words >= set(names), (table, lines[start:])
    assert max(len(line) for line in lines) <= TABLE_WIDTH


def test_comparison_is_the_ratio_of_medians_where_both_ran() -> None:
    assert comparisons(_rows()) == [("relayd-mooncake", "mooncake-raw", [(MIB, 1.5)])]
    assert comparisons([ok("mooncake-raw", MIB, [1])]) == []


def test_table_prints_the_comparison_and_sums_both_daemons() -> None:
    text = render_table(_rows())
    assert "relayd-mooncake / mooncake-raw: x1.50 at 1MiB\n" in text
    # CPU µs w/r/d of relayd-mooncake: d = 30 µs (the writer's daemon) + 40 µs (the reader's),
    # and so are their wake-ups: 0.25 + 0.5 a transfer
    assert "10/20/70         0.75  " in text
    assert "the writer's daemon + the reader's" in text
    assert "d wk: times the daemon's event loop was woken" in text


def test_a_long_comparison_wraps_within_the_table_width() -> None:
    sizes = [(k + 1) * 3 * MIB + 5 for k in range(12)]
    rows = [ok(m, s, [1_000]) for s in sizes for m in ("mooncake-raw", "relayd-mooncake")]
    lines = render_table(rows).splitlines()
    assert max(len(line) for line in lines) <= TABLE_WIDTH
    start = next(i for i, line in enumerate(lines) if line.startswith("relayd-mooncake /"))
    assert lines[start + 1].startswith("    x1.00 at ")


def test_json_carries_the_comparison_and_each_daemons_cpu() -> None:
    doc = json.loads(json.dumps(to_json(_rows(), machine={}, run={})))
    assert doc["comparisons"] == [
        {
            "method": "relayd-mooncake",
            "baseline": "mooncake-raw",
            "ratio_of_medians": [{"size": MIB, "ratio": 1.5}],
        }
    ]
    row = next(r for r in doc["results"] if r["method"] == "relayd-mooncake" and r["size"] == MIB)
    assert row["cpu_ns_per_transfer"]["daemon"] == 70e3
    assert row["daemon_cpu_ns_per_transfer"] == {"writer_side": 30e3, "reader_side": 40e3}
    assert row["daemon_wakeups_per_transfer"] == {"writer_side": 0.25, "reader_side": 0.5}
    floor = next(r for r in doc["results"] if r["method"] == "floor")
    assert floor["daemon_cpu_ns_per_transfer"] == {"writer_side": None, "reader_side": None}
    assert floor["daemon_wakeups_per_transfer"] == {"writer_side": None, "reader_side": None}


@requires_mooncake
def test_mooncake_raw_moves_the_payload_between_two_engines() -> None:
    import torch

    from relayd_bench._mooncake import MooncakeRaw

    ctx = BenchContext(run_id="t", shm_prefix="relayd-bench-t-")
    writer, reader = MooncakeRaw(ctx), MooncakeRaw(ctx)
    size = 300 * KIB + 7  # not a page multiple: slots are padded, reads are exact
    source = make_source(size)
    stamp = Stamp(source)
    blob = writer.setup_writer(size, source)
    try:
        reader.setup_reader(size, blob)
        try:
            for i in range(6):  # more than the slots, so each is reused
                stamp(i)
                got = reader.recv(memoryview(writer.send(i)))
                check_tensor(got, size, i)
                assert torch.equal(got, source)
                del got
                reader.cleanup()
        finally:
            reader.teardown_reader()
    finally:
        writer.teardown_writer()
    assert writer.engine is None and reader.engine is None
