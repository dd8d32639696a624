"""Freed notices: telling a writer which of its leases' slots it may reuse, batched.

A writer needs Freed only to reuse the slots of grants it holds, and it holds
several idle grants' worth; a writer that runs short asks for a grant, which
sends its notices at once (:meth:`FreedBatcher.send` from the grant queue).
So they can wait: batching turns one wakeup of the writer (and a send here)
per transfer into one per linger. Not once a writer's pending notices give
back :data:`FREED_LINGER_MAX_BYTES`, though: a writer that cannot reuse the
slots it just wrote takes cache-cold ones, and copying into cold memory makes
4 MiB transfers about 12% slower. And not while a grant waits for space.

A session that took a Freed ring (:mod:`relayd_client.wire.rings`) gets
its arena leases' ids written there instead, at once and with no frame: it
reads them when it next cuts a lease, so nothing wakes it. Frames remain for
the rest: leases of other pools, a full ring, and any lease freed while a
grant waits for space (a writer blocked in that wait does not read its ring;
a grant request nudges it with an empty Freed if its ring holds unread ids).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from relayd_client.wire.framing import FREED_LINGER_MAX_BYTES
from relayd_client.wire.rings import IdRing

from .events import Freed


class FreedBatcher:
    """Freed lease ids pending per writer session, and when they go."""

    def __init__(
        self,
        linger: float,
        deliver: Callable[[str, Freed], None],
        space_short: Callable[[], bool] = lambda: False,
    ) -> None:
        # Pending notices wait this long to be batched (0: sent at the end of each turn).
        self.linger = linger
        self.deliver = deliver  # (writer session id, its notice)
        self.space_short = space_short  # whether some grant waits for space
        self._ids: dict[str, list[int]] = {}
        self._bytes: dict[str, int] = {}  # the slot bytes they give back, by session
        self._rings: dict[str, IdRing] = {}
        self._timer: asyncio.TimerHandle | None = None
        # Lease ids told to writers, by the way they went (metrics read them).
        self.by_ring = 0
        self.by_frame = 0

    def attach_ring(self, session_id: str, ring: IdRing) -> None:
        """``session_id`` reads its arena leases' Freed from ``ring`` from now on."""
        old = self._rings.pop(session_id, None)
        if old is not None:
            old.close()
        self._rings[session_id] = ring

    def add(self, session_id: str, lease_id: int, nbytes: int, *, arena: bool = True) -> None:
        ring = self._rings.get(session_id)
        if ring is not None and arena and not self.space_short() and ring.push(lease_id):
            self.by_ring += 1
            return
        self._ids.setdefault(session_id, []).append(lease_id)
        self._bytes[session_id] = self._bytes.get(session_id, 0) + nbytes

    def pending(self, session_id: str) -> bool:
        """Whether the session has Freed to hear: pending here, or unread in its ring."""
        if self._ids.get(session_id):
            return True
        ring = self._rings.get(session_id)
        return ring is not None and ring.unread()

    def drop(self, session_id: str) -> None:
        """Forget what is pending for a session that closed, and unmap its ring."""
        self._ids.pop(session_id, None)
        self._bytes.pop(session_id, None)
        ring = self._rings.pop(session_id, None)
        if ring is not None:
            ring.close()

    def flush(self, *, space_short: bool) -> None:
        """Send what is due now; arm the linger for the rest."""
        if self.linger <= 0 or space_short:
            self.send()
            return
        due = [sid for sid, n in self._bytes.items() if n >= FREED_LINGER_MAX_BYTES]
        if due:
            self.send(due)
        if self._ids and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.linger, self.send)

    def send(self, session_ids: Iterable[str] | None = None) -> None:
        """One Freed to each of ``session_ids`` (default: every session with notices pending).

        A session named here whose ring holds unread ids gets a Freed even with
        none pending: an empty one, which makes the writer read its ring.
        """
        if session_ids is None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            session_ids = list(self._ids)
        for sid in session_ids:
            ids = self._ids.pop(sid, None)
            self._bytes.pop(sid, None)
            if ids:
                self.by_frame += len(ids)
                self.deliver(sid, Freed(tuple(ids)))
            elif (ring := self._rings.get(sid)) is not None and ring.unread():
                self.deliver(sid, Freed(()))
