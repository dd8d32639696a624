"""Request records: which stages wrote and read a request, its live leases, and aborts.

``abort(request_id)`` needs to know who may abort (a stage that wrote or reads
the request) and which leases to free; an abort that arrives before anything
was written leaves a tombstone, so the leases that come later are freed as
they are published. Records are kept in touch order, so the sweep that drops
old ones stops at the first it keeps.
"""

from __future__ import annotations

import dataclasses

from .records import Lease

# A request's record outlives its last lease this long (seconds), so a late
# abort or a late writer still finds it ...
REQUEST_MEMORY = 300.0
# ... but no more than this many records of requests with no lease left: at
# thousands of requests a second, 300 s of them would be hundreds of MB.
MAX_REQUEST_RECORDS = 1 << 16
# Abort tombstones of requests nobody wrote yet are the one record a client can
# create without holding memory; cap them so Abort cannot grow the daemon.
MAX_TOMBSTONES = 1 << 14


@dataclasses.dataclass(eq=False)
class RequestInfo:
    writers: set[str] = dataclasses.field(default_factory=set)
    readers: set[str] = dataclasses.field(default_factory=set)
    leases: set[int] = dataclasses.field(default_factory=set)
    aborted: bool = False
    touched: float = 0.0
    # Stages that aborted the request before any lease of it existed; the
    # tombstone only binds leases those stages write or read.
    aborters: set[str] = dataclasses.field(default_factory=set)

    @property
    def involved(self) -> set[str]:
        """The stages that wrote, read or aborted the request."""
        return self.writers | self.readers | self.aborters


class Requests:
    def __init__(self) -> None:
        self.by_id: dict[str, RequestInfo] = {}

    def get(self, request_id: str) -> RequestInfo | None:
        return self.by_id.get(request_id)

    def is_aborted(self, request_id: str) -> bool:
        req = self.by_id.get(request_id)
        return req is not None and req.aborted

    def touch(self, request_id: str, now: float) -> RequestInfo:
        """The record of ``request_id``, moved to the young end."""
        req = self.by_id.pop(request_id, None) or RequestInfo()
        req.touched = now
        self.by_id[request_id] = req
        return req

    def add(self, lease: Lease, now: float) -> RequestInfo:
        """Record ``lease`` under its request."""
        req = self.touch(lease.request_id, now)
        req.writers.add(lease.from_stage)
        req.readers.add(lease.to_stage)
        req.leases.add(lease.id)
        return req

    def remove(self, lease: Lease) -> None:
        req = self.by_id.get(lease.request_id)
        if req is not None:
            req.leases.discard(lease.id)

    def tombstone(self, request_id: str, stages: tuple[str, ...], now: float) -> None:
        """Remember an abort of a request nobody wrote yet (by ``stages``)."""
        if len(self.by_id) >= MAX_TOMBSTONES:
            # dicts keep insertion order: the oldest records go first.
            empty = [r for r, v in self.by_id.items() if not v.leases]
            for rid in empty[: MAX_TOMBSTONES // 4]:
                del self.by_id[rid]
        req = self.by_id[request_id] = RequestInfo(touched=now)
        req.aborters.update(stages)

    def forget_old(self, now: float) -> None:
        """Drop records with no lease left that are old, or beyond the cap (oldest first)."""
        excess = len(self.by_id) - MAX_REQUEST_RECORDS
        old: list[str] = []
        for rid, req in self.by_id.items():  # oldest first
            if excess <= 0 and now - req.touched <= REQUEST_MEMORY:
                break
            if not req.leases:
                old.append(rid)
                excess -= 1
        for rid in old:
            del self.by_id[rid]
