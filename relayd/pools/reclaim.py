"""Freeing what nobody else will: abort, the TTL sweep, and drain.

``abort(request_id)`` frees every published lease of the request and tells
the request's own stages (a client remembers aborted ids and refuses puts to
them, which must not reach uninvolved stages). An abort before any lease of
the request exists leaves a tombstone (:mod:`relayd.pools.requests`). A
published lease nobody reads is freed after the TTL; at the end of a drain
whatever is left is freed.

Whose request it is: request ids are the clients' to choose, and readable in
any DataRef, so a stage of another uid could write one lease under a
request id of yours and then abort "its" request. An abort frees the whole
request only when every session that wrote it on this node ran as the
aborting session's uid (or the aborter runs as root), a copy the daemon pulled
or that a push landed counting as written by the sessions it is read for (the
intruder would otherwise be the only writer of record of a reader's node);
otherwise it is narrowed to the aborter's own stages
(:meth:`Reclaimer.narrowed_to`): only the leases they write or read are
freed, only they are told, and only such leases are stopped later. A pipeline
whose stages all run as one uid is never narrowed.

A peer's abort is narrowed here by the same rule, against the uid and stages
its node names for the aborter (:class:`Aborter`): uids mean something only
per node, so a node whose own writers of the request all share the aborter's
uid frees it whole, and one where another uid wrote it narrows it.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from relayd_client.wire.errors import PermissionDeniedError

from .events import Aborted, Draining
from .lease_table import LeaseTable
from .records import LeaseState, ReclaimReason
from .sessions import Session

log = logging.getLogger(__name__)


class Aborter(NamedTuple):
    """Who aborts a request, as narrowing sees it: a session's uid and stages."""

    uid: int
    stages: tuple[str, ...]


class Reclaimer:
    def __init__(self, table: LeaseTable, lease_ttl: float) -> None:
        self.table = table
        self.lease_ttl = lease_ttl

    def abort(self, session: Session, request_id: str) -> tuple[int, int]:
        """``session`` aborts ``request_id``: (leases freed, their bytes)."""
        self.check_abort(session.stages, request_id)
        return self.abort_request(request_id, self.narrowed_to(session, request_id))

    def narrowed_to(self, by: Session | Aborter, request_id: str) -> tuple[str, ...] | None:
        """The stages an abort of ``request_id`` by ``by`` is narrowed to: None (the
        whole request) when only sessions of its uid wrote the request here, or it
        runs as root; else its own stages."""
        req = self.table.requests.get(request_id)
        if by.uid == 0 or req is None or all(uid == by.uid for uid in req.uids):
            return None
        # Where a pipeline's uids differ, or an intruder tried: the operator's clue.
        log.info(
            "abort narrowed to the aborter's stages: other uids wrote the request here",
            extra={
                "request_id": request_id,
                "uid": by.uid,
                "stages": ",".join(by.stages),
                "writer_uids": ",".join(map(str, req.uids)),
            },
        )
        return by.stages

    def check_abort(self, stages: tuple[str, ...], request_id: str) -> bool:
        """Whether ``stages`` may abort ``request_id``: True when this node knows
        they wrote or read it, False when nobody here did yet (then any stage may,
        ahead of time, again too, and one stage's tombstone must not lock out
        another's); PermissionDeniedError when others did and they did not."""
        t = self.table
        req = t.requests.get(request_id)
        if req is None or not (req.writers or req.readers):
            t.requests.tombstone(request_id, stages, t.clock())
            return False
        if not any(st in req.writers or st in req.readers for st in stages):
            raise PermissionDeniedError(
                f"stage(s) {', '.join(stages)} neither wrote nor read request {request_id!r}"
            )
        return True

    def abort_request(
        self, request_id: str, stages: tuple[str, ...] | None = None
    ) -> tuple[int, int]:
        """Free every published lease of ``request_id`` (whoever asked was checked), or
        with ``stages`` (see :meth:`narrowed_to`) those they write or read."""
        t = self.table
        now = t.clock()
        if stages is not None:
            t.requests.tombstone(request_id, stages, now)  # what it stops from now on
        req = t.requests.touch(request_id, now)
        req.aborted = True
        n = nbytes = 0
        for lease_id in req.live_leases():
            lease = t.leases.get(lease_id)
            if (
                lease is not None
                and lease.state is not LeaseState.RESERVED
                and (stages is None or lease.from_stage in stages or lease.to_stage in stages)
            ):
                n += 1
                nbytes += lease.nbytes
                t.free(lease, ReclaimReason.ABORT)
        told = req.involved if stages is None else set(stages)
        t.sessions.tell_all(Aborted(request_id), stages=told or None)
        t.flush()
        return n, nbytes

    def expire(self, now: float) -> int:
        """Free the published leases nobody read within the TTL: how many."""
        t = self.table
        expired = [
            lease for lease in t.leases.values()
            if lease.state is LeaseState.PUBLISHED and now - lease.published_at > self.lease_ttl
        ]  # fmt: skip
        for lease in expired:
            try:
                t.free(lease, ReclaimReason.TTL)
            except Exception:  # one bad record must not stop the sweep
                log.exception("could not expire lease %d", lease.id)
        return len(expired)

    def start_drain(self) -> None:
        self.table.queue.drain()
        self.table.sessions.tell_all(Draining())

    def drop_all(self) -> None:
        """End of drain: whatever is left is reclaimed (and counted)."""
        for lease in list(self.table.leases.values()):
            self.table.free(lease, ReclaimReason.DRAIN)
