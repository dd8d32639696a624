"""Batched reports: transfers the daemon never sees, and every call's latency.

Inline and local_object puts (and direct CUDA handles) never touch a lease,
so the daemon hears of them only from these reports; latencies of every put
and get go the same way. Both wait :data:`REPORT_LINGER_S` for company and
leave in one frame.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .wire import latency
from .wire.compact import RefFields
from .wire.proto import relay_pb2 as pb

if TYPE_CHECKING:
    from ._connection import Connection

REPORT_LINGER_S = 0.2
# Puts and gets noted and not counted yet, at most (see Reports.observe).
_SEEN_MAX = 4096


def _call_later(delay: float, callback: Callable[[], None]) -> None:
    asyncio.get_running_loop().call_later(delay, callback)


class Reports:
    """One client's pending transfer counts and latency buckets.

    :attr:`later` schedules the flush on the client's loop; a client whose
    calls run on other threads replaces it with a thread-safe one.
    """

    def __init__(self, conn: Connection, lock: threading.RLock, from_stage: str) -> None:
        self._conn = conn
        self._lock = lock
        self._from_stage = from_stage
        # (transport, to_stage) -> [count, bytes]
        self._counts: dict[tuple[pb.Transport, str], list[int]] = {}
        self._latency = latency.EdgeLatency()
        # Puts and gets noted, not yet counted: (op, from, to, transport, ns).
        self._seen: collections.deque[tuple[int, str, str, int, int]] = collections.deque()
        self._due = False
        self.later: Callable[[float, Callable[[], None]], None] = _call_later

    def transfer(self, transport: pb.Transport, nbytes: int, to_stage: str) -> None:
        with self._lock:
            entry = self._counts.get((transport, to_stage))
            if entry is None:
                entry = self._counts[transport, to_stage] = [0, 0]
            entry[0] += 1
            entry[1] += nbytes
            self._soon()

    def observe(self, op: int, m: RefFields, start_ns: int) -> None:
        """Note one put or get (of ``m``) of ``start_ns`` ago, for its edge's latency
        buckets; counted there when the report goes (:meth:`_count_seen`).

        This runs right after a put's or get's copy, which evicted what counting
        touches (the lock, the edge's dict and its list of buckets); a deque's
        append takes no lock and touches one object.
        """
        seen = self._seen
        seen.append(
            (op, m.origin.stage, m.to_stage, m.transport, time.perf_counter_ns() - start_ns)
        )
        if not self._due or len(seen) >= _SEEN_MAX:
            with self._lock:
                self._soon()
                if len(seen) >= _SEEN_MAX:  # no report went for a while: count them here
                    self._count_seen()

    def _count_seen(self) -> None:
        """Move what :meth:`observe` noted into the buckets; under the lock. Taken
        from the deque's left while any thread may append on its right: nothing
        noted is lost or counted twice."""
        seen, observe = self._seen, self._latency.observe
        for _ in range(len(seen)):
            observe(*seen.popleft())

    def _soon(self) -> None:
        # Under the lock.
        if not self._due:
            self._due = True
            self.later(REPORT_LINGER_S, self.flush)

    def flush(self) -> None:
        with self._lock:
            self._due = False
            session = self._conn.session
            if session.closed:
                return
            counts, self._counts = self._counts, {}
            self._count_seen()
            drained = self._latency.drain()
            if not counts and not drained:
                return
            frame = session.pending
            for (transport, to_stage), (count, nbytes) in counts.items():
                frame.report.add(
                    transport=transport,
                    count=count,
                    bytes=nbytes,
                    from_stage=self._from_stage,
                    to_stage=to_stage,
                )
            frame.latency.extend(drained)
            session.mark(flush=True)
