"""Request records: which stages wrote and read a request, its live leases, and aborts.

``abort(request_id)`` needs to know who may abort (a stage that wrote or reads
the request) and which leases to free; an abort that arrives before anything
was written leaves a tombstone, so the leases that come later are freed as
they are published. Records are kept in touch order, so the sweep that drops
old ones stops at the first it keeps.
"""

from __future__ import annotations

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


# Stage names of one record: a tuple while few (a hostile writer naming a new
# to_stage per lease must not make each add cost the length), then a set.
Names = tuple[str, ...] | set[str]
FEW_NAMES = 4
# ... and no more than this many: a writer may name any to_stage and cancel the
# lease at once, and a record it keeps touching is never dropped, so each name
# would stay. A request passes through a few stages; later names go unrecorded.
MAX_NAMES = 64


def _joined(names: Names, name: str) -> Names:
    if name in names or len(names) >= MAX_NAMES:
        return names
    if isinstance(names, set):
        names.add(name)
        return names
    return (*names, name) if len(names) < FEW_NAMES else {*names, name}


class RequestInfo:
    """One request's record: who wrote, read or aborted it, and its live leases.

    Kept small for the garbage collector: the daemon remembers up to
    :data:`MAX_REQUEST_RECORDS` of these, and every container in them is an
    object each full collection walks. Stage names are in tuples (untracked
    once they hold only strings) and the lease set exists only while a lease
    does, so a remembered record is one object, not six (a full collection
    over 65,536 records: ~15 ms as one object each, ~107 ms as six, measured).
    """

    __slots__ = ("aborted", "aborters", "leases", "readers", "touched", "uids", "writers")

    def __init__(self, touched: float = 0.0) -> None:
        self.writers: Names = ()
        self.readers: Names = ()
        # Stages that aborted the request before any lease of it existed; the
        # tombstone only binds leases those stages write or read.
        self.aborters: Names = ()
        self.leases: set[int] | None = None  # live lease ids; None when there are none
        # The uids of the sessions that wrote it here, and of those the daemon's
        # own copies (pulled, landed) are read for: whose request it is, for an
        # abort (see Reclaimer).
        self.uids: tuple[int, ...] = ()
        self.aborted = False
        self.touched = touched

    def add_uid(self, uid: int) -> None:
        if uid not in self.uids and len(self.uids) < MAX_NAMES:
            self.uids = (*self.uids, uid)

    @property
    def involved(self) -> set[str]:
        """The stages that wrote, read or aborted the request."""
        return {*self.writers, *self.readers, *self.aborters}

    def live_leases(self) -> list[int]:
        return list(self.leases or ())

    def stops(self, from_stage: str, to_stage: str) -> bool:
        """Whether its abort stops a transfer ``from_stage`` -> ``to_stage``: an
        abort ahead of time binds only what its stages write or read."""
        return self.aborted and (
            not self.aborters or from_stage in self.aborters or to_stage in self.aborters
        )


class Requests:
    def __init__(self) -> None:
        self.by_id: dict[str, RequestInfo] = {}

    def get(self, request_id: str) -> RequestInfo | None:
        return self.by_id.get(request_id)

    def is_aborted(self, request_id: str) -> bool:
        req = self.by_id.get(request_id)
        return req is not None and req.aborted

    def stops(self, request_id: str, from_stage: str, to_stage: str) -> bool:
        """Whether an abort of ``request_id`` stops a transfer ``from_stage`` -> ``to_stage``."""
        req = self.by_id.get(request_id)
        # Once per published transfer: the common answer without a method call.
        return req is not None and req.aborted and req.stops(from_stage, to_stage)

    def touch(self, request_id: str, now: float) -> RequestInfo:
        """The record of ``request_id``, moved to the young end."""
        req = self.by_id.pop(request_id, None) or RequestInfo()
        req.touched = now
        self.by_id[request_id] = req
        return req

    def add(self, lease: Lease, now: float, uid: int | None = None) -> RequestInfo:
        """Record ``lease`` under its request (``uid``: of the session that wrote it, or
        that it is read for)."""
        rid = lease.request_id
        req = self.by_id.pop(rid, None)
        if req is None:
            # Once per Reserve of a new request (each put, in a stop-and-wait
            # pipeline): its record made whole at once (4.5 -> 2.2 us, measured).
            req = self.by_id[rid] = RequestInfo(now)
            req.writers, req.readers = (lease.from_stage,), (lease.to_stage,)
            req.leases = {lease.id}
            if uid is not None:
                req.uids = (uid,)
            return req
        req.touched = now
        self.by_id[rid] = req
        if uid is not None:
            req.add_uid(uid)
        req.writers = _joined(req.writers, lease.from_stage)
        req.readers = _joined(req.readers, lease.to_stage)
        if req.leases is None:
            req.leases = {lease.id}
        else:
            req.leases.add(lease.id)
        return req

    def remove(self, lease: Lease) -> None:
        req = self.by_id.get(lease.request_id)
        if req is not None and req.leases is not None:
            req.leases.discard(lease.id)
            if not req.leases:
                req.leases = None

    def tombstone(self, request_id: str, stages: tuple[str, ...], now: float) -> None:
        """Remember an abort of a request nobody wrote yet (by ``stages``, with
        the stages of an earlier tombstone of it)."""
        if request_id not in self.by_id and len(self.by_id) >= MAX_TOMBSTONES:
            # dicts keep insertion order: the oldest records go first.
            empty = [r for r, v in self.by_id.items() if v.leases is None]
            for rid in empty[: MAX_TOMBSTONES // 4]:
                del self.by_id[rid]
        req = self.touch(request_id, now)
        if req.aborted and not req.aborters:
            return  # aborted for every stage already (by a peer): nothing to narrow
        for stage in stages:
            req.aborters = _joined(req.aborters, stage)

    def forget_old(self, now: float) -> None:
        """Drop records with no lease left that are old, or beyond the cap (oldest first)."""
        excess = len(self.by_id) - MAX_REQUEST_RECORDS
        old: list[str] = []
        for rid, req in self.by_id.items():  # oldest first
            if excess <= 0 and now - req.touched <= REQUEST_MEMORY:
                break
            if req.leases is None:
                old.append(rid)
                excess -= 1
        for rid in old:
            del self.by_id[rid]
