"""The benchmark's arithmetic and output shapes: exact numbers on known samples, no timing."""

from __future__ import annotations

import json

import pytest

from relayd_bench import _cli
from relayd_bench._cli import parse_size, parse_sizes
from relayd_bench._registry import ENTRIES, STREAM, select
from relayd_bench._run import REFERENCE_PLAN, plan_for
from relayd_bench._stats import (
    Cpu,
    Result,
    Split,
    Status,
    StreamResult,
    add_ratios,
    add_stream_ratios,
    machine_info,
    median,
    p99,
    percentile_nearest_rank,
    split_of,
    summarize,
    throughput_gbps,
    to_json,
    worst_by_second,
)
from relayd_bench._table import TABLE_WIDTH, fmt_ns, fmt_size, render_table
from tests.unit._bench_results import ok

KIB, MIB = 1 << 10, 1 << 20


def test_median_odd_count_is_the_middle_sample() -> None:
    assert median([5, 1, 3]) == 3


def test_median_even_count_is_the_mean_of_the_two_middle_samples() -> None:
    assert median([4, 1, 3, 2]) == 2.5


@pytest.mark.parametrize(
    ("samples", "want"),
    [
        (list(range(1, 101)), 99),  # ceil(0.99 * 100) = 99th smallest
        (list(range(1, 1001)), 990),
        (list(range(1, 11)), 10),  # ceil(9.9) = 10: with few samples p99 is the maximum
        (list(range(1, 201)), 198),
        ([7], 7),
        (list(range(100, 0, -1)), 99),  # order of the input does not matter
    ],
)
def test_p99_is_nearest_rank(samples: list[int], want: int) -> None:
    assert p99(samples) == want


def test_p99_is_always_a_real_sample() -> None:
    samples = [10, 20, 30]
    assert p99(samples) in samples


def test_percentile_nearest_rank_edges() -> None:
    assert percentile_nearest_rank([3, 1, 2], 100) == 3
    assert percentile_nearest_rank([3, 1, 2], 1) == 1
    assert percentile_nearest_rank(list(range(1, 101)), 50) == 50


@pytest.mark.parametrize("bad", [0, 101, -5])
def test_percentile_rejects_out_of_range_q(bad: int) -> None:
    with pytest.raises(ValueError):
        percentile_nearest_rank([1, 2, 3], bad)


def test_empty_samples_are_an_error_not_a_zero() -> None:
    with pytest.raises(ValueError):
        median([])
    with pytest.raises(ValueError):
        p99([])


def test_summarize() -> None:
    s = summarize([4, 2, 8, 6])
    assert (s.n, s.median_ns, s.p99_ns, s.min_ns, s.max_ns, s.mean_ns) == (4, 5.0, 8, 2, 8, 5.0)


def test_throughput_is_size_over_median_in_decimal_gb_per_s() -> None:
    assert throughput_gbps(1_000_000, 1_000_000) == pytest.approx(1.0)  # 1 MB in 1 ms
    assert throughput_gbps(MIB, 100_000) == pytest.approx(10.48576)
    assert ok("floor", MIB, [100_000]).gbps == pytest.approx(10.48576)


def test_ratios_are_against_floor_at_the_same_size() -> None:
    rows = [
        ok("floor", 4 * KIB, [10, 10, 10]),
        ok("floor", MIB, [100, 100, 100]),
        ok("relayd-shm", 4 * KIB, [25, 25, 25]),
        ok("relayd-shm", MIB, [150, 150, 150]),
        ok("memcpy", 16 * MIB, [5]),  # no floor at this size
        Result("pickle-uds", MIB, Status.FAILED, "boom"),
    ]
    add_ratios(rows)
    assert [r.ratio_vs_floor for r in rows] == [1.0, 1.0, 2.5, 1.5, None, None]


def test_stream_ratios_match_on_streams_chunk_and_rate() -> None:
    def s(method: str, samples: list[int], streams: int = 4) -> StreamResult:
        return StreamResult(method, streams, MIB, 50.0, Status.OK, latency=summarize(samples))

    rows = [s("floor", [100]), s("relayd-shm", [300]), s("relayd-shm", [300], streams=2)]
    add_stream_ratios(rows)
    assert [r.ratio_vs_floor for r in rows] == [1.0, 3.0, None]
    assert rows[0].target_chunks_per_s == 200.0


def test_worst_latency_per_second_spans_every_stream() -> None:
    # two streams at 2 chunks/s: chunks 0-1 are due in second 0, 2-3 in second 1, 4 in 2
    streams = [[10, 20, 30, 40, 50], [15, 5, 99, 1]]
    assert worst_by_second(streams, 2.0) == (20, 99, 50)
    assert worst_by_second([], 50.0) == ()


def test_stream_table_shows_the_worst_latency_of_each_second() -> None:
    row = StreamResult(
        "relayd-mooncake", 16, MIB, 50.0, Status.OK, chunks=3, latency=summarize([1, 2, 3]),
        worst_by_second_ns=(1_900_000, 160_300_000, 2_400_000),
    )  # fmt: skip
    lines = render_table([], [row]).splitlines()
    at = lines.index("worst latency per second (one stall: one high second; queueing: many)")
    assert lines[at + 1].split() == ["relayd-mooncake", "1.90", "ms", "160", "ms", "2.40", "ms"]


@pytest.mark.parametrize(
    ("ns", "text"),
    [
        (900, "0.9 µs"),
        (44_300, "44.3 µs"),
        (307_000, "307 µs"),
        (1_230_000, "1.23 ms"),
        (13_200_000, "13.2 ms"),
        (2_500_000_000, "2.50 s"),
        (None, "-"),
    ],
)
def test_fmt_ns_three_significant_figures(ns: float | None, text: str) -> None:
    assert fmt_ns(ns) == text


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (4 * KIB, "4KiB"),
        (256 * KIB, "256KiB"),
        (16 * MIB, "16MiB"),
        (1000, "1000B"),
        (1536 * KIB, "1536KiB"),  # exact in KiB beats a rounded MiB
        (1_500_000, "1.4MiB"),
    ],
)
def test_fmt_size(size: int, text: str) -> None:
    assert fmt_size(size) == text


def _busy_results() -> tuple[list[Result], list[StreamResult]]:
    sizes = [4 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
    methods = ["memcpy", "floor", "a-very-long-method-name-that-goes-on", "relayd-shm-view"]
    rows: list[Result] = []
    for m in methods:
        for i, size in enumerate(sizes):
            rows.append(
                ok(
                    m,
                    size,
                    [1_000 * (i + 1), 90_000_000_000 * (i + 1)],
                    cpu=Cpu(123456.0, 654321.0, 99999.0, 4096.0, 8160.0),
                    extra={"transport": "shm", "note": "x" * 80},
                    split=Split(12_345_678.0, 9_999_999.0, 123_456_789.0),
                )
            )
    rows.append(Result("relayd-mooncake", 4 * KIB, Status.SKIPPED, "needs " + "y" * 200))
    rows.append(Result("relayd-shm", MIB, Status.FAILED, "z" * 300))
    add_ratios(rows)
    streams = [
        StreamResult(
            "floor",
            16,
            MIB,
            1000.0,
            Status.OK,
            chunks=123456,
            latency=summarize([1_000, 9_000_000_000]),
            aggregate_chunks_per_s=15999.9,
            cpu=Cpu(1e6, 1e6, 1e6),
            worst_by_second_ns=(9_000_000_000,) * 30,
        ),
        StreamResult("relayd-shm", 16, MIB, 1000.0, Status.FAILED, "q" * 300),
    ]
    return rows, streams


def test_table_lines_fit_in_100_columns() -> None:
    rows, streams = _busy_results()
    machine = {"cpu_model": "C" * 150, "cores": 2, "kernel": "6.18", "python": "3.11.7"}
    text = render_table(rows, streams, machine)
    lines = text.splitlines()
    assert len(lines) > 20
    assert max(len(line) for line in lines) <= TABLE_WIDTH
    assert all(line == line.rstrip() for line in lines)


def test_table_names_every_method_and_size_and_status() -> None:
    rows, streams = _busy_results()
    text = render_table(rows, streams)
    for name in ("memcpy", "floor", "relayd-shm-view", "relayd-mooncake", "relayd-shm"):
        assert name in text
    for size in ("4KiB", "256MiB"):
        assert size in text
    assert "skipped: needs" in text
    assert "failed: zzz" in text


def test_table_collapses_a_method_skipped_at_every_size_into_one_line() -> None:
    rows = [ok("floor", s, [10]) for s in (4 * KIB, MIB)]
    rows += [
        Result("relayd-shm", s, Status.SKIPPED, "cannot import relayd_client")
        for s in (4 * KIB, MIB)
    ]
    text = render_table(rows)
    assert text.count("skipped: cannot import relayd_client") == 1


def test_a_split_is_each_parts_own_median() -> None:
    parts = [(30_000, 14_000, 31_000), (32_000, 90_000, 29_000), (35_000, 12_000, 400_000)]
    assert split_of(parts) == Split(32_000.0, 14_000.0, 31_000.0)
    assert split_of([]) is None  # a local method has no sides


def test_the_table_shows_each_pair_cell_split_by_method_and_size() -> None:
    rows = [
        ok("floor", 4 * KIB, [15_000], split=Split(2_400.0, 11_600.0, 3_100.0)),
        ok("floor", MIB, [200_000], split=Split(61_000.0, 20_000.0, 118_000.0)),
        ok("relayd-sync", 4 * KIB, [77_000], split=Split(32_000.0, 14_000.0, 31_000.0)),
        ok("memcpy", 4 * KIB, [1_000]),  # local: no split, no row
    ]
    lines = render_table(rows).splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("where the time went"))
    matrix = lines[head + 3 : head + 6]
    assert matrix[0].split() == ["method", "4KiB", "1MiB"]
    assert matrix[1].split() == ["floor", "2/12/3", "61/20/118"]
    assert matrix[2].split() == ["relayd-sync", "32/14/31"]  # no cell where it did not run
    assert not any(line.startswith("memcpy") for line in lines[head:])
    assert "where the time went" not in render_table([ok("memcpy", 4 * KIB, [1_000])])


def test_json_schema_keys() -> None:
    rows, streams = _busy_results()
    doc = json.loads(json.dumps(to_json(rows, streams, machine_info(), {"run_id": "r"})))
    assert set(doc) >= {"schema", "created", "machine", "run", "results", "streams"}
    assert doc["schema"] == "relayd-bench/1"
    assert set(doc["machine"]) >= {"cpu_model", "cores", "kernel", "python", "torch"}
    row = doc["results"][0]
    assert set(row) >= {
        "method",
        "size",
        "status",
        "reason",
        "warmup",
        "iterations",
        "median_ns",
        "p99_ns",
        "latency_ns",
        "gbps",
        "ratio_vs_floor",
        "cycle_median_ns",
        "split_ns",
        "cpu_ns_per_transfer",
        "minflt_per_transfer",
        "extra",
    }
    assert set(row["cpu_ns_per_transfer"]) == {"writer", "reader", "daemon"}
    assert row["split_ns"] == {
        "send_ns": 12_345_678.0,
        "trip_ns": 9_999_999.0,
        "recv_ns": 123_456_789.0,
    }
    assert set(row["latency_ns"]) == {"n", "median_ns", "p99_ns", "min_ns", "max_ns", "mean_ns"}
    skipped = next(r for r in doc["results"] if r["status"] == "skipped")
    assert skipped["median_ns"] is None and skipped["latency_ns"] is None
    stream = doc["streams"][0]
    assert set(stream) >= {
        "method",
        "streams",
        "chunk_size",
        "rate_hz",
        "chunks",
        "latency_ns",
        "aggregate_chunks_per_s",
        "target_chunks_per_s",
        "aggregate_gbps",
        "cpu_ns_per_chunk",
    }


def test_plan_uses_the_reference_counts_and_scales_them() -> None:
    for size, warmup, iterations in REFERENCE_PLAN:
        plan = plan_for(size, 1.0)
        assert (plan.warmup, plan.iterations) == (warmup, iterations)
    assert (plan_for(4 * KIB, 0.1).warmup, plan_for(4 * KIB, 0.1).iterations) == (30, 300)
    assert plan_for(64 * KIB, 1.0).iterations == 3000  # between sizes: the smaller's counts
    assert plan_for(16 * MIB, 0.001).iterations >= 20  # never too few for a p99


def test_sizes_are_binary() -> None:
    assert parse_sizes("4K,256K,1M,4M,16M") == (4 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB)
    assert parse_size("16MiB") == 16 * MIB
    assert parse_size("65536") == 65536
    with pytest.raises(ValueError):
        parse_size("lots")


def test_method_selection_keeps_registry_order_and_rejects_unknown_names() -> None:
    assert select("pickle-uds,floor") == ["floor", "pickle-uds"]
    assert STREAM in select(None)
    assert set(select("relayd")) == {n for n in ENTRIES if n.startswith("relayd-")}
    with pytest.raises(ValueError, match="unknown method"):
        select("floor,nope")


def test_machine_line_reports_the_load_at_start_and_end() -> None:
    from relayd_bench._table import _machine_line

    m = {"cpu_model": "X", "cores": 2, "loadavg": [16.3, 7.9, 3.0], "loadavg_at_start": [0.26]}
    assert _machine_line(m).endswith("\nload (1-min average) 0.3 at start, 16.3 at end")
    assert _machine_line({"loadavg": [1.0, 2.0, 3.0]}).endswith("· load 1.0/2.0")


def test_list_names_every_method_whole_with_its_summary_in_one_column(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _cli.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [*ENTRIES, STREAM]
    columns = {len(line) - len(line[len(line.split()[0]) :].lstrip()) for line in lines}
    assert len(columns) == 1, lines


def test_stream_table_keeps_names_that_share_a_prefix_apart() -> None:
    streams = [
        StreamResult(
            name,
            16,
            256 * KIB,
            50.0,
            Status.OK,
            chunks=100,
            latency=summarize([1_000, 2_000]),
            aggregate_chunks_per_s=800.0,
        )
        for name in ("relayd-mooncake", "relayd-mooncake-view")
    ]
    lines = render_table([ok("floor", MIB, [10])], streams).splitlines()
    words = {line.split()[0] for line in lines if line.startswith("relayd-")}
    assert words == {"relayd-mooncake", "relayd-mooncake-view"}, lines
