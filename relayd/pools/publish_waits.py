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
import contextlib
from collections.abc import Callable

#: How long such a read waits: far beyond a writer's linger, so that only a
#: writer that never publishes (or died) makes a read wait this long.
PUBLISH_WAIT_S = 1.0
#: Reads waiting at once, over all sessions; beyond it a read is answered at
#: once, so that no client can park an unbounded number of calls here.
MAX_WAITING = 1024


class PublishWaits:
    """Who waits for which lease's Publish; woken by the lease table's ``published``."""

    def __init__(self) -> None:
        self._waiting: dict[int, list[Callable[[], None]]] = {}
        self._count = 0

    def published(self, lease_id: int) -> None:
        wakes = self._waiting.pop(lease_id, None)
        if wakes is not None:
            self._count -= len(wakes)
            for wake in wakes:
                wake()

    async def wait(self, lease_id: int, timeout: float | None = None) -> None:
        """Until ``lease_id`` is published or ``timeout`` (:data:`PUBLISH_WAIT_S`)
        passes; the caller looks at the lease again either way."""
        if self._count >= MAX_WAITING:
            return
        done = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not done.done():
                done.set_result(None)

        self._waiting.setdefault(lease_id, []).append(wake)
        self._count += 1
        try:
            await asyncio.wait((done,), timeout=PUBLISH_WAIT_S if timeout is None else timeout)
        finally:
            wakes = self._waiting.get(lease_id)
            if wakes is not None and wake in wakes:  # timed out or cancelled
                wakes.remove(wake)
                self._count -= 1
                if not wakes:
                    del self._waiting[lease_id]
            with contextlib.suppress(asyncio.InvalidStateError):
                done.cancel()

    @property
    def waiting(self) -> int:
        return self._count
