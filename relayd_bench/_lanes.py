"""The lanes of one benchmark process: several streams that one process carries.

In the stream workload a writer (or reader) process may carry several streams at
once (``JobSpec.lanes``), as a thinker and a talker carry many requests each.
Every lane runs the same loop as a one-stream process, with its own method
instance and channel; what they share is here: they start each size together on
one schedule base (``Start``), the parent gets one report per size with every
lane's samples (``Reports``), blocking lanes run on threads (``in_threads``), and
what a real process would hold once (a client, an engine) its lanes share
(``shared``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from relayd_bench._api import ReaderReport, Usage, WriterReport

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.synchronize import Barrier

T = TypeVar("T")

BARRIER_TIMEOUT_S = 120.0
START_MARGIN_NS = 2_000_000  # after the barrier, time for every stream to reach its loop


def merged(reports: Sequence[WriterReport | ReaderReport]) -> WriterReport | ReaderReport:
    """One process's report for a size from its lanes' (lane 0's first).

    Each lane's usage is the whole process's over that lane's window, and the
    windows nearly coincide: the widest stands for the process, never their sum.
    """
    first = reports[0]
    usage = Usage(max(r.usage.cpu_ns for r in reports), max(r.usage.minflt for r in reports))
    if isinstance(first, ReaderReport):
        readers = [r for r in reports if isinstance(r, ReaderReport)]
        samples = tuple(s for r in readers for s in r.samples_ns)
        parts = tuple(p for r in readers for p in r.parts_ns)
        return dataclasses.replace(first, usage=usage, samples_ns=samples, parts_ns=parts)
    writers = [r for r in reports if isinstance(r, WriterReport)]
    return dataclasses.replace(
        first,
        usage=usage,
        cycles_ns=tuple(c for w in writers for c in w.cycles_ns),
        start_ns=min(w.start_ns for w in writers),
        end_ns=max(w.end_ns for w in writers),
    )


class Reports:
    """Where a process's lanes report: the parent gets one report per size."""

    def __init__(self, conn: Connection, lanes: int) -> None:
        self._conn, self._lanes = conn, lanes
        self._held: dict[tuple[type, str, int], dict[int, WriterReport | ReaderReport]] = {}
        self._lock = threading.Lock()  # blocking lanes report from their threads

    def send(self, lane: int, report: WriterReport | ReaderReport) -> None:
        if self._lanes == 1:
            self._conn.send(report)
            return
        key = (type(report), report.method, report.size)
        with self._lock:
            got = self._held.setdefault(key, {})
            got[lane] = report
            if len(got) < self._lanes:
                return
            del self._held[key]
        self._conn.send(merged([got[j] for j in sorted(got)]))


class Start:
    """The lanes of a writer process start each size together, on one schedule base.

    With several processes (per-stream pairs) the writers also meet at ``barrier``;
    one lane waits there for all of its process's lanes.
    """

    def __init__(self, lanes: int, barrier: Barrier | None) -> None:
        self._lanes, self._barrier = lanes, barrier
        self._threads = threading.Barrier(lanes, action=self._go)
        self._tasks: asyncio.Barrier | None = None  # made on the loop that uses it
        self.base_ns = 0

    def _go(self) -> None:
        if self._barrier is not None:
            self._barrier.wait(BARRIER_TIMEOUT_S)
        self.base_ns = time.perf_counter_ns() + START_MARGIN_NS

    def wait(self) -> int:
        self._threads.wait(BARRIER_TIMEOUT_S)
        return self.base_ns

    async def await_(self) -> int:
        if self._tasks is None:
            self._tasks = asyncio.Barrier(self._lanes)
        if await asyncio.wait_for(self._tasks.wait(), BARRIER_TIMEOUT_S) == 0:
            if self._barrier is None:
                self._go()  # no other process to wait for: no executor thread either
            else:
                # in a thread, so the client's background tasks keep running meanwhile
                await asyncio.get_running_loop().run_in_executor(None, self._go)
        await asyncio.wait_for(self._tasks.wait(), BARRIER_TIMEOUT_S)
        return self.base_ns


def in_threads(lanes: Sequence[Callable[[], None]]) -> None:
    """Run blocking lanes, one thread each; the first failure is raised here.

    The threads are daemons: after a failure the process reports and exits without
    waiting for lanes still blocked on their channels.
    """
    if len(lanes) == 1:
        lanes[0]()  # one lane: on this thread, as every stop-and-wait job runs
        return
    ended: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()

    def lane(body: Callable[[], None]) -> None:
        try:
            body()
        except BaseException as exc:
            ended.put(exc)
        else:
            ended.put(None)

    for body in lanes:
        threading.Thread(target=lane, args=(body,), name="bench-lane", daemon=True).start()
    for _ in lanes:
        while True:
            try:  # in slices, so SIGTERM's SystemExit is raised on this thread
                exc = ended.get(timeout=1.0)
            except queue.Empty:
                continue
            if exc is not None:
                raise exc
            break


@dataclasses.dataclass
class _Held:
    value: Any
    users: int = 0


_SHARED: dict[Hashable, _Held] = {}
_SHARED_LOCK = threading.Lock()  # blocking lanes are threads


@contextlib.contextmanager
def shared(key: Hashable, open_: Callable[[], T], close: Callable[[T], None]) -> Iterator[T]:
    """One object per process and ``key``: its first user opens it, its last closes it."""
    with _SHARED_LOCK:
        held = _SHARED.get(key)
        if held is None:
            held = _SHARED[key] = _Held(open_())  # under the lock: other lanes wait for it
        held.users += 1
    try:
        yield held.value
    finally:
        with _SHARED_LOCK:
            held.users -= 1
            last = not held.users
            if last:
                del _SHARED[key]
        if last:
            close(held.value)
