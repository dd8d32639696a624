"""Reports: every put and get noted is counted once, whichever thread notes it and
whenever the report goes."""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from typing import Any, cast

from relayd_client._reports import _SEEN_MAX, Reports
from relayd_client.wire import latency
from relayd_client.wire.proto import relay_pb2 as pb

THREADS, EACH = 4, 3000


class _Session:
    def __init__(self) -> None:
        self.closed = False
        self.pending = pb.SessionFrame()

    def mark(self, *, flush: bool = False, **_: Any) -> None:
        assert flush


def _reports() -> tuple[Reports, _Session, list[Callable[[], None]]]:
    session = _Session()
    conn = types.SimpleNamespace(session=session)
    reports = Reports(cast(Any, conn), threading.RLock(), "w")
    scheduled: list[Callable[[], None]] = []
    reports.later = lambda delay, callback: scheduled.append(callback)  # never runs by itself
    return reports, session, scheduled


def _ref(to_stage: str = "r") -> Any:
    origin = types.SimpleNamespace(stage="w")
    return types.SimpleNamespace(origin=origin, to_stage=to_stage, transport=pb.TRANSPORT_SHM)


def _counted(session: _Session) -> int:
    """Puts and gets counted in the reports sent so far."""
    return sum(sum(r.put_buckets) + sum(r.get_buckets) for r in session.pending.latency)


def test_a_noted_call_is_counted_when_the_report_goes() -> None:
    reports, session, scheduled = _reports()
    reports.observe(latency.PUT, _ref(), 0)
    reports.observe(latency.GET, _ref(), 0)
    assert _counted(session) == 0 and len(scheduled) == 1  # one flush asked for
    reports.flush()
    (report,) = session.pending.latency
    assert (report.from_stage, report.to_stage) == ("w", "r")
    assert sum(report.put_buckets) == 1 and sum(report.get_buckets) == 1
    assert report.put_sum_ns > 0


def test_threads_noting_while_reports_go_lose_and_repeat_nothing() -> None:
    reports, session, _ = _reports()
    start = threading.Barrier(THREADS + 1)

    def note() -> None:
        start.wait(10)
        for _ in range(EACH):
            reports.observe(latency.PUT, _ref(), 0)

    threads = [threading.Thread(target=note) for _ in range(THREADS)]
    for t in threads:
        t.start()
    start.wait(10)
    while any(t.is_alive() for t in threads):
        reports.flush()
    for t in threads:
        t.join(10)
    reports.flush()
    assert _counted(session) == THREADS * EACH


def test_a_report_that_never_goes_leaves_the_notes_bounded() -> None:
    reports, session, scheduled = _reports()
    for _ in range(2 * _SEEN_MAX + 10):
        reports.observe(latency.GET, _ref(), 0)
    assert len(reports._seen) < _SEEN_MAX  # counted by the callers meanwhile
    assert len(scheduled) == 1
    reports.flush()
    assert _counted(session) == 2 * _SEEN_MAX + 10
