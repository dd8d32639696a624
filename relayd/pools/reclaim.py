"""Freeing what nobody else will: abort, the TTL sweep, and drain.

``abort(request_id)`` frees every published lease of the request and tells
the request's own stages (a client remembers aborted ids and refuses puts to
them, which must not reach uninvolved stages). An abort before any lease of
the request exists leaves a tombstone (:mod:`relayd.pools.requests`). A
published lease nobody reads is freed after the TTL; at the end of a drain
whatever is left is freed.
"""

from __future__ import annotations

import logging

from relayd_client.wire.errors import PermissionDeniedError

from .events import Aborted, Draining
from .lease_table import LeaseTable
from .records import LeaseState, ReclaimReason
from .sessions import Session

log = logging.getLogger(__name__)


class Reclaimer:
    def __init__(self, table: LeaseTable, lease_ttl: float) -> None:
        self.table = table
        self.lease_ttl = lease_ttl

    def abort(self, session: Session, request_id: str) -> tuple[int, int]:
        """``session`` aborts ``request_id``: (leases freed, their bytes)."""
        self.check_abort(session.stages, request_id)
        return self.abort_request(request_id)

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

    def abort_request(self, request_id: str) -> tuple[int, int]:
        """Free every published lease of ``request_id`` (whoever asked was checked)."""
        t = self.table
        req = t.requests.touch(request_id, t.clock())
        req.aborted = True
        n = nbytes = 0
        for lease_id in req.live_leases():
            lease = t.leases.get(lease_id)
            if lease is not None and lease.state is not LeaseState.RESERVED:
                n += 1
                nbytes += lease.nbytes
                t.free(lease, ReclaimReason.ABORT)
        involved = req.involved
        t.sessions.tell_all(Aborted(request_id), stages=involved or None)
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
