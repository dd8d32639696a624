"""The round-trip model: counts from daemon counters, modelled latencies, the table's section."""

from __future__ import annotations

import pytest

from relayd_bench._rtt import (
    EXTRA_RT,
    MODEL_RTTS_NS,
    ReadCounts,
    bare_read_round_trips,
    model_rows,
    modelled_ns,
    parse_rt,
    read_counts,
    relayd_round_trips,
)
from relayd_bench._table import TABLE_WIDTH, render_table
from tests.unit._bench_results import ok

KIB = 1 << 10


@pytest.mark.parametrize(
    ("counts", "want"),
    [
        (ReadCounts(landed=4), 0.5),  # the DataRef's one-way trip only
        (ReadCounts(awaited=4), 1.5),  # WRITE + ack, then Landed; the DataRef overlaps
        (ReadCounts(pulled=4, pull_phases=8), 2.5),  # DataRef, data read, header read
        (ReadCounts(pulled=4, pull_phases=4), 1.5),  # as the daemon counted: one phase each
        (ReadCounts(pulled=4), 2.5),  # a daemon that does not count phases: two each
        (ReadCounts(landed=1, awaited=2, pulled=1, pull_phases=2), (0.5 + 3.0 + 2.5) / 4),
        (ReadCounts(attached=4), 0.5),  # bytes and Landed in one trip, beside the DataRef
        (ReadCounts(awaited=1, attached=3), (1.5 + 3 * 0.5) / 4),
        (ReadCounts(announced=4), 0.5),  # landed and announced: the get asked nothing
        (ReadCounts(awaited=1, announced=1), (1.5 + 0.5) / 2),
    ],
)
def test_relayd_round_trips_weight_each_kind_of_read(counts: ReadCounts, want: float) -> None:
    assert relayd_round_trips(counts) == pytest.approx(want)


def test_no_counted_read_is_no_figure_not_zero() -> None:
    assert relayd_round_trips(ReadCounts()) is None
    assert bare_read_round_trips(0, 0) is None


def test_bare_read_is_the_datarefs_trip_plus_one_per_read() -> None:
    assert bare_read_round_trips(10, 10) == pytest.approx(1.5)
    assert bare_read_round_trips(20, 10) == pytest.approx(2.5)


def test_modelled_is_measured_plus_round_trips_times_rtt() -> None:
    assert MODEL_RTTS_NS == (50_000, 200_000, 1_000_000)
    assert modelled_ns(300_000, 1.5, 200_000) == pytest.approx(600_000)
    assert modelled_ns(300_000, 0.5, 1_000_000) == pytest.approx(800_000)
    [(method, size, med, rt, cells)] = model_rows([("m", KIB, 100_000.0, 2.5)])
    assert (method, size, med, rt) == ("m", KIB, 100_000.0, 2.5)
    assert cells == pytest.approx([225_000, 600_000, 2_600_000])


def test_read_counts_sum_over_peers_and_subtract() -> None:
    before = read_counts({"peers": [{"reads_landed": "1"}, {"reads_pulled": "2"}]})
    after = read_counts(
        {
            "peers": [
                {"reads_landed": "3", "reads_awaited": "5"},
                {"reads_pulled": "3", "pull_phases": "2", "reads_attached": "4"},
                {"reads_announced": "6"},
            ]
        }
    )
    assert after - before == ReadCounts(
        landed=2, awaited=5, pulled=1, pull_phases=2, attached=4, announced=6
    )
    assert read_counts({}) == ReadCounts()


def test_parse_rt_ignores_garbage() -> None:
    assert parse_rt({EXTRA_RT: "1.50"}) == 1.5
    assert parse_rt({EXTRA_RT: "x"}) is None
    assert parse_rt({}) is None


def test_table_has_the_round_trip_and_modelled_columns() -> None:
    results = [
        ok("mooncake-raw", 256 * KIB, [100_000] * 3, extra={EXTRA_RT: "1.50"}),
        ok(
            "relayd-mooncake",
            256 * KIB,
            [300_000] * 3,
            extra={EXTRA_RT: "0.50", "rt+": "1.50", "reads": "4/0/0"},
        ),
        ok("relayd-shm", 256 * KIB, [50_000] * 3, extra={"transport": "shm"}),
    ]
    table = render_table(results)
    lines = table.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("size") and "RT" in line)
    assert lines[head].split() == [
        *("size", "method", "median", "RT", "RT+"),
        *("RTT", "50us", "RTT", "200us", "RTT", "1ms", "reads"),
    ]
    assert lines[head + 1].split()[1:] == [
        *("mooncake-raw", "100", "µs", "1.50", "1.50", "175", "µs", "400", "µs", "1.60", "ms", "-")
    ]
    assert lines[head + 2].split()[1:] == [
        *(
            "relayd-mooncake",
            "300",
            "µs",
            "0.50",
            "1.50",
            "325",
            "µs",
            "400",
            "µs",
            "800",
            "µs",
            "4/0/0",
        )
    ]
    # relayd-shm counted no round trips: not modelled; the pair's modelled ratio follows
    assert lines[head + 3] == (
        "relayd-mooncake / mooncake-raw modelled, 256KiB: x1.86 at 50us, x1.00 at 200us,"
        " x0.50 at 1ms"
    )
    assert lines[head + 4] == "   with RT+: x2.14, x1.50, x1.12"
    assert len(lines) == head + 5
    assert all(len(line) <= TABLE_WIDTH for line in lines)


def test_no_round_trips_no_section() -> None:
    table = render_table([ok("relayd-shm", 256 * KIB, [50_000] * 3, extra={"transport": "shm"})])
    assert not any(line.startswith("size") and " RT " in line for line in table.splitlines())
