"""Several streams in one benchmark process: how they split, start and report."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, cast

import pytest

from relayd_bench._api import (
    BenchContext,
    JobSpec,
    Pace,
    ReaderReport,
    SizePlan,
    Step,
    Usage,
    WriterReport,
)
from relayd_bench._child import _Schedule
from relayd_bench._harness import JobOutcome, run_jobs
from relayd_bench._lanes import Reports, Start, in_threads, shared
from relayd_bench._procstat import ProcSample
from relayd_bench._progress import Progress
from relayd_bench._run import stream_lanes
from tests.unit._bench_methods import BREAKS_AT, BROKEN_LANE, PAUSE_S

LANES = 3


@pytest.mark.parametrize(
    ("streams", "pairs", "lanes"),
    [(16, 1, [16]), (16, 16, [1] * 16), (5, 2, [3, 2]), (3, 8, [1, 1, 1]), (4, 0, [4])],
)
def test_streams_split_over_pairs_as_evenly_as_they_can(
    streams: int, pairs: int, lanes: list[int]
) -> None:
    assert stream_lanes(streams, pairs) == lanes


class _Pipe:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)


def _writer(lane: int, daemon: ProcSample | None) -> WriterReport:
    return WriterReport(
        "relayd-shm",
        1 << 20,
        Usage(cpu_ns=1000 + lane, minflt=10 - lane),
        cycles_ns=(lane * 10 + 1, lane * 10 + 2),
        daemon=daemon,
        reader_daemon=None,
        start_ns=100 - lane,
        end_ns=200 + lane,
        extra={"lane": str(lane)},
    )


def test_a_process_sends_one_report_per_size_with_every_lanes_samples() -> None:
    pipe = _Pipe()
    reports = Reports(cast(Any, pipe), LANES)
    lane0_daemon = ProcSample(cpu_ns=5, wakeups=1)
    for lane in (2, 0, 1):  # lanes finish in any order
        reports.send(lane, _writer(lane, lane0_daemon if lane == 0 else None))
        reports.send(lane, ReaderReport("relayd-shm", 1 << 20, Usage(7, 1), (lane,)))
    writer, reader = pipe.sent[0], pipe.sent[1]
    assert len(pipe.sent) == 2, "one report per kind and size, not one per lane"
    assert isinstance(writer, WriterReport) and isinstance(reader, ReaderReport)
    assert writer.cycles_ns == (1, 2, 11, 12, 21, 22)  # every lane's, lane 0's first
    assert reader.samples_ns == (0, 1, 2)
    # each lane's usage is the process's over its window: the widest, never the sum
    assert writer.usage == Usage(1002, 10)
    assert (writer.start_ns, writer.end_ns) == (98, 202)
    assert writer.daemon == lane0_daemon and writer.extra == {"lane": "0"}


def test_one_lane_reports_straight_through() -> None:
    pipe = _Pipe()
    report = _writer(0, None)
    Reports(cast(Any, pipe), 1).send(0, report)
    assert pipe.sent == [report]


def test_blocking_lanes_start_on_one_base_after_the_last_arrives() -> None:
    start = Start(LANES, None)
    bases: list[int] = []
    arrived: list[int] = []

    def lane() -> None:
        arrived.append(time.perf_counter_ns())
        bases.append(start.wait())

    threads = [threading.Thread(target=lane) for _ in range(LANES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(bases) == LANES and len(set(bases)) == 1
    assert bases[0] > max(arrived)


def test_coroutine_lanes_start_on_one_base_after_the_last_arrives() -> None:
    start = Start(LANES, None)

    async def lane(turns: int) -> tuple[int, int]:
        for _ in range(turns):  # arrive at different turns of the loop
            await asyncio.sleep(0)
        return time.perf_counter_ns(), await start.await_()

    async def main() -> list[tuple[int, int]]:
        return await asyncio.gather(*(lane(10 * j) for j in range(LANES)))

    got = asyncio.run(main())
    assert len({base for _, base in got}) == 1
    assert got[0][1] > max(arrived for arrived, _ in got)


def test_lanes_are_spread_over_a_period() -> None:
    pace = Pace(period_ns=1000, offset_ns=50, lane_step_ns=100)
    due = [_Schedule(pace, lane, base_ns=0)._due(2) for lane in range(LANES)]
    assert due == [2050, 2150, 2250]
    assert _Schedule(None, 1, base_ns=0)._due(2) is None  # stop-and-wait: never due


def test_a_failing_blocking_lane_is_raised_while_the_others_still_block() -> None:
    stuck = threading.Event()

    def blocked() -> None:
        stuck.wait(30)

    def broken() -> None:
        raise ValueError("lane 1 broke")

    try:
        with pytest.raises(ValueError, match="lane 1 broke"):
            in_threads([blocked, broken, blocked])
    finally:
        stuck.set()


def test_lanes_that_all_end_return() -> None:
    ran: list[int] = []
    in_threads([lambda: ran.append(0), lambda: ran.append(1)])
    in_threads([lambda: ran.append(2)])  # one lane: on the calling thread
    assert sorted(ran) == [0, 1, 2]


def test_lanes_share_one_object_opened_by_the_first_and_closed_by_the_last() -> None:
    opened: list[object] = []
    closed: list[object] = []

    def open_() -> object:
        opened.append(object())
        return opened[-1]

    with shared("k", open_, closed.append) as a, shared("k", open_, closed.append) as b:
        assert a is b and len(opened) == 1
        with shared("other", open_, closed.append) as c:
            assert c is not a  # another key, another object
        assert closed == [c]
    assert closed == [c, a]  # once, when the last lane left
    with shared("k", open_, closed.append) as again:
        assert again is not a and len(opened) == 3  # a fresh one after the last closed


def _job(target: str, lanes: int) -> JobOutcome:
    plan = SizePlan(size=4096, warmup=2, iterations=20)
    spec = JobSpec(
        (Step("copy", f"tests.unit._bench_methods:{target}", (plan,)),),
        BenchContext(run_id="t", shm_prefix="relayd-bench-t-"),
        lanes=lanes,
    )
    [outcome] = run_jobs(
        [spec],
        local=False,
        timeout_s=120,
        progress=Progress(enabled=False),
        describe=lambda *_: "",
    )
    return outcome


@pytest.mark.parametrize("target", ["Copy", "AsyncCopy"])
def test_a_process_pair_carries_its_lanes_and_reports_them_as_one(target: str) -> None:
    outcome = _job(target, LANES)
    assert outcome.errors == []
    writer, reader = outcome.writer["copy", 4096], outcome.reader["copy", 4096]
    assert len(writer.cycles_ns) == len(reader.samples_ns) == LANES * 20


@pytest.mark.parametrize(("target", "slow"), [("SlowSendCopy", 0), ("SlowRecvAsyncCopy", 2)])
def test_each_sample_splits_into_its_sides_and_a_slow_side_shows_in_its_own_part(
    target: str, slow: int
) -> None:
    outcome = _job(target, LANES)
    assert outcome.errors == []
    reader = outcome.reader["copy", 4096]
    assert len(reader.parts_ns) == len(reader.samples_ns) == LANES * 20
    for sample, parts in zip(reader.samples_ns, reader.parts_ns, strict=True):
        assert sum(parts) == sample  # the same transfer's stamps, in order
        assert min(parts) >= 0
        assert parts[slow] >= PAUSE_S * 1e9  # a sleep there lands there, never elsewhere


@pytest.mark.parametrize("target", ["BrokenCopy", "BrokenAsyncCopy"])
def test_one_broken_lane_fails_the_job_with_its_own_error(target: str) -> None:
    outcome = _job(target, LANES)
    assert outcome.error is not None
    assert outcome.error.role == "writer"
    assert f"lane {BROKEN_LANE} broke at transfer {BREAKS_AT}" in outcome.error.message
    assert ("copy", 4096) not in outcome.writer  # no report from a broken size
