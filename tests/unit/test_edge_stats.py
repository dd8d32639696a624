"""Per-edge series: shared latency buckets, bounded labels, hostile reports, exposition."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from relayd_client.wire.latency import BOUNDS, BOUNDS_NS, GET, NBUCKETS, PUT, EdgeLatency, quantile
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.edges import MAX_REPORT_COUNT, OTHER, EdgeStats
from relayd.metrics import Metrics

SHM, INLINE, LOCAL = pb.TRANSPORT_SHM, pb.TRANSPORT_INLINE, pb.TRANSPORT_LOCAL_OBJECT


def _metrics(stats: EdgeStats) -> CollectorRegistry:
    m = Metrics(CollectorRegistry())
    m.attach_edges(stats)
    return m.registry


def _series(registry: CollectorRegistry, name: str) -> list[dict[str, str]]:
    return [s.labels for fam in registry.collect() for s in fam.samples if s.name == name]


def _latency(
    src: str, dst: str, transport: int = SHM, put: list[int] | None = None, **kw: object
) -> pb.EdgeLatencyReport:
    return pb.EdgeLatencyReport(
        from_stage=src,
        to_stage=dst,
        transport=transport,  # type: ignore[arg-type]
        put_buckets=put if put is not None else [1] + [0] * (NBUCKETS - 1),
        **kw,  # type: ignore[arg-type]
    )


# ---------------------------------------------------------------- buckets


def test_bounds_run_from_10us_to_10s_and_client_and_daemon_agree() -> None:
    assert BOUNDS[0] == 10e-6 and BOUNDS[-1] == 10.0
    assert list(BOUNDS) == sorted(BOUNDS) and len(set(BOUNDS)) == len(BOUNDS)
    assert [round(b * 1e9) for b in BOUNDS] == list(BOUNDS_NS)
    assert len(BOUNDS) + 1 == NBUCKETS


@pytest.mark.parametrize(
    ("ns", "bucket"),
    [(0, 0), (10_000, 0), (10_001, 1), (150_000, 4), (10 * 10**9, 18), (10 * 10**9 + 1, 19)],
)
def test_an_observation_lands_in_the_first_bucket_whose_bound_holds_it(
    ns: int, bucket: int
) -> None:
    acc = EdgeLatency()
    acc.observe(PUT, "a", "b", SHM, ns)
    (rep,) = acc.drain()
    assert list(rep.put_buckets) == [int(i == bucket) for i in range(NBUCKETS)]
    assert rep.put_sum_ns == ns
    assert not rep.get_buckets
    assert acc.drain() == []


def test_puts_and_gets_of_one_edge_share_a_report() -> None:
    acc = EdgeLatency()
    for ns in (15_000, 15_000, 3 * 10**6):
        acc.observe(PUT, "a", "b", SHM, ns)
    acc.observe(GET, "a", "b", SHM, 40_000)
    acc.observe(GET, "a", "b", INLINE, 40_000)
    reps = {r.transport: r for r in acc.drain()}
    assert reps.keys() == {SHM, INLINE}
    assert sum(reps[SHM].put_buckets) == 3 and reps[SHM].put_buckets[1] == 2
    assert reps[SHM].put_sum_ns == 3_030_000
    assert reps[SHM].get_buckets[2] == 1 and not reps[INLINE].put_buckets


def test_quantile_answers_bucket_upper_bounds() -> None:
    buckets = [0] * NBUCKETS
    assert quantile(buckets, 0.5) is None
    buckets[4], buckets[6] = 99, 1
    assert quantile(buckets, 0.5) == BOUNDS[4]
    assert quantile(buckets, 0.99) == BOUNDS[4]
    assert quantile(buckets, 1.0) == BOUNDS[6]
    buckets[NBUCKETS - 1] = 1000
    assert quantile(buckets, 0.99) == BOUNDS[-1]  # "10 s or more"


# ---------------------------------------------------------------- labels


def test_only_attached_stages_become_labels() -> None:
    stats = EdgeStats(max_edges=64)
    stats.attached(["thinker", "talker"])
    stats.count("thinker", "talker", "shm", 1, 100)
    stats.count("thinker", "req-1234", "shm", 1, 100)  # never attached: not a label
    registry = _metrics(stats)
    assert (
        registry.get_sample_value(
            "relayd_edge_transfers_total",
            {"from_stage": "thinker", "to_stage": "talker", "transport": "shm"},
        )
        == 1
    )
    assert (
        registry.get_sample_value(
            "relayd_edge_transfers_total",
            {"from_stage": OTHER, "to_stage": OTHER, "transport": "shm"},
        )
        == 1
    )


def test_a_flood_of_1000_stage_names_keeps_the_series_bounded() -> None:
    stats = EdgeStats(max_edges=64)
    names = [f"stage-{i}" for i in range(1000)]
    stats.attached(names)
    stages = set(names)
    for i, name in enumerate(names):
        other = names[(i + 1) % len(names)]
        stats.count(name, other, "shm", 1, 10)
        stats.count(name, f"never-attached-{i}", "inline", 1, 10)
        assert stats.add_latency(stages, _latency(name, other))
    registry = _metrics(stats)
    for family in (
        "relayd_edge_transfers_total",
        "relayd_edge_bytes_total",
        "relayd_put_seconds_count",
    ):
        series = _series(registry, family)
        edges = {(s["from_stage"], s["to_stage"]) for s in series}
        assert len(edges) == 64 + 1, family  # 64 named edges and other -> other
        assert (OTHER, OTHER) in edges
    # Nothing is lost: everything past the cap is counted under other.
    total = sum(
        registry.get_sample_value("relayd_edge_transfers_total", labels) or 0
        for labels in _series(registry, "relayd_edge_transfers_total")
    )
    assert total == 2000
    assert (
        registry.get_sample_value(
            "relayd_edge_transfers_total",
            {"from_stage": OTHER, "to_stage": OTHER, "transport": "inline"},
        )
        == 1000
    )


def test_max_edges_zero_labels_nothing() -> None:
    stats = EdgeStats(max_edges=0)
    stats.attached(["a", "b"])
    stats.count("a", "b", "shm", 1, 1)
    assert [(k.from_stage, k.to_stage) for k, _ in stats.series()] == [(OTHER, OTHER)]


# ---------------------------------------------------------------- hostile reports

GOOD = [0, 2, 1] + [0] * (NBUCKETS - 3)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(_latency("a", "b", put=[1] * (NBUCKETS - 1)), id="short bucket array"),
        pytest.param(_latency("a", "b", put=[1] * (NBUCKETS + 1)), id="long bucket array"),
        pytest.param(_latency("a", "b", put=[0] * NBUCKETS), id="no observations"),
        pytest.param(
            _latency("a", "b", put=[2**64 - 1] + [0] * (NBUCKETS - 1)), id="negative as uint64"
        ),
        pytest.param(
            _latency("a", "b", put=[MAX_REPORT_COUNT] + [0] * (NBUCKETS - 1)), id="huge count"
        ),
        pytest.param(_latency("a", "b", put=GOOD, put_sum_ns=2**64 - 1), id="huge sum"),
        pytest.param(_latency("a", "b", transport=0, put=GOOD), id="unspecified transport"),
        pytest.param(_latency("a", "b", transport=99, put=GOOD), id="unknown transport"),
        pytest.param(_latency("x", "b", put=GOOD), id="puts from a stage it does not serve"),
        pytest.param(
            pb.EdgeLatencyReport(from_stage="a", to_stage="x", transport=SHM, get_buckets=GOOD),
            id="gets at a stage it does not serve",
        ),
        pytest.param(pb.EdgeLatencyReport(from_stage="a", to_stage="b"), id="empty"),
    ],
)
def test_a_latency_report_that_does_not_fit_is_dropped_whole(bad: pb.EdgeLatencyReport) -> None:
    stats = EdgeStats()
    stats.attached(["a", "b"])
    assert not stats.add_latency({"a"}, bad)
    assert stats.series() == []


def test_a_valid_latency_report_is_exposed_as_a_histogram() -> None:
    stats = EdgeStats()
    stats.attached(["a", "b"])
    assert stats.add_latency({"a"}, _latency("a", "b", put=GOOD, put_sum_ns=70_000))
    assert stats.add_latency(
        {"b"}, pb.EdgeLatencyReport(from_stage="a", to_stage="b", transport=SHM, get_buckets=GOOD)
    )
    registry = _metrics(stats)
    labels = {"from_stage": "a", "to_stage": "b", "transport": "shm"}
    get = registry.get_sample_value
    assert get("relayd_put_seconds_bucket", {**labels, "le": "1e-05"}) == 0
    assert get("relayd_put_seconds_bucket", {**labels, "le": "2e-05"}) == 2
    assert get("relayd_put_seconds_bucket", {**labels, "le": "5e-05"}) == 3
    assert get("relayd_put_seconds_bucket", {**labels, "le": "+Inf"}) == 3
    assert get("relayd_put_seconds_count", labels) == 3
    assert get("relayd_put_seconds_sum", labels) == pytest.approx(70e-6)
    assert get("relayd_get_seconds_count", labels) == 3
    # The transfers themselves are counted by whoever saw them, not by latency reports.
    assert get("relayd_edge_transfers_total", labels) is None


@pytest.mark.parametrize(
    ("rep", "ok"),
    [
        (
            pb.TransferReport(transport=INLINE, count=3, bytes=30, from_stage="a", to_stage="b"),
            True,
        ),
        (pb.TransferReport(transport=LOCAL, count=1, bytes=30, from_stage="a", to_stage="b"), True),
        # the daemon counts shm transfers itself: a report would count them twice
        (pb.TransferReport(transport=SHM, count=3, bytes=30, from_stage="a", to_stage="b"), False),
        (
            pb.TransferReport(transport=INLINE, count=0, bytes=0, from_stage="a", to_stage="b"),
            False,
        ),
        (pb.TransferReport(transport=INLINE, count=2**64 - 1, from_stage="a", to_stage="b"), False),
        (
            pb.TransferReport(transport=INLINE, count=1, bytes=2**60, from_stage="a", to_stage="b"),
            False,
        ),
        (
            pb.TransferReport(transport=INLINE, count=1, bytes=1, from_stage="z", to_stage="b"),
            False,
        ),
        (pb.TransferReport(transport=INLINE, count=1, bytes=1, to_stage="b"), False),
    ],
)
def test_transfer_reports_are_checked(rep: pb.TransferReport, ok: bool) -> None:
    assert EdgeStats().check_report({"a"}, rep) is ok


def test_status_carries_the_same_numbers() -> None:
    stats = EdgeStats()
    stats.attached(["a", "b"])
    stats.count("a", "b", "shm", 2, 2048)
    stats.add_latency({"a"}, _latency("a", "b", put=GOOD, put_sum_ns=70_000))
    (row,) = stats.status()
    assert (row.from_stage, row.to_stage, row.transport) == ("a", "b", SHM)
    assert (row.transfers, row.bytes) == (2, 2048)
    assert list(row.put_buckets) == GOOD and sum(row.get_buckets) == 0
    assert row.put_p50_seconds == BOUNDS[1] and row.put_p99_seconds == BOUNDS[2]
    assert row.get_p99_seconds == 0.0
