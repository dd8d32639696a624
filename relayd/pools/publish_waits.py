"""Reads through the daemon that came before their lease's Publish.

A writer's Publish lingers on its side (up to the client's ``NOTICE_LINGER_S``)
and a reader that maps the arena does not need it: the slot header says the
bytes are in. A reader on the socket fallback does, because the daemon copies
the lease out for it, so its ``GetBytes`` may wait, briefly, for a Publish
that can still come: its lease is reserved, or not yet announced in a live
grant of a live writer. Anything else is answered at once.
"""

from __future__ import annotations

import asyncio

from ..shares import Shares

#: How long such a read waits: far beyond a writer's linger, so that only a
#: writer that never publishes (or died) makes a read wait this long.
PUBLISH_WAIT_S = 1.0
#: Reads waiting at once, over all sessions; beyond it a read is answered at
#: once, so that no client can park an unbounded number of calls here.
MAX_WAITING = 1024
#: ... and from the sessions of one uid. A session may name any id of any live
#: grant not announced yet, and one uid may hold half the daemon's sessions:
#: without a share of its own one uid could keep every place taken, and every
#: other reader's overtaking read would be answered at once, stale.
MAX_WAITING_PER_UID = MAX_WAITING // 4


class PublishWaits:
    """Who waits for which lease's Publish; woken by the lease table's ``published``."""

    def __init__(self) -> None:
        self._waiting: dict[int, list[asyncio.Future[None]]] = {}
        self._count = 0  # the futures in _waiting, for the cap without a sum
        self._per_uid: Shares[int] = Shares()

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def published(self, lease_id: int) -> None:
        futures = self._waiting.pop(lease_id, None)
        if futures is not None:
            self._count -= len(futures)
            for fut in futures:
                if not fut.done():
                    fut.set_result(None)

    async def wait(self, lease_id: int, uid: int) -> None:
        """Until ``lease_id`` is published or :data:`PUBLISH_WAIT_S` passes; the
        caller (a session of ``uid``) looks at the lease again either way."""
        if self._count >= MAX_WAITING or self._per_uid[uid] >= MAX_WAITING_PER_UID:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(lease_id, []).append(fut)
        self._count += 1
        self._per_uid.add(uid)
        try:
            await asyncio.wait((fut,), timeout=PUBLISH_WAIT_S)
        finally:
            if not fut.done():  # timed out or cancelled: still listed
                futures = self._waiting[lease_id]
                futures.remove(fut)
                self._count -= 1
                if not futures:
                    del self._waiting[lease_id]
            self._per_uid.take(uid)

    @property
    def waiting(self) -> int:
        return self._count

    def from_uid(self, uid: int) -> int:
        """Reads of ``uid``'s sessions waiting now."""
        return self._per_uid[uid]
