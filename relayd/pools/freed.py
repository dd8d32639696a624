"""Freed notices: telling a writer which of its leases' slots it may reuse, batched.

A writer needs Freed only to reuse the slots of grants it holds, and it holds
several idle grants' worth; a writer that runs short asks for a grant, which
sends its notices at once (:meth:`FreedBatcher.send` from the grant queue).
So they can wait: batching turns one wakeup of the writer (and a send here)
per transfer into one per linger. Not once a writer's pending notices give
back :data:`FREED_LINGER_MAX_BYTES`, though: a writer that cannot reuse the
slots it just wrote takes cache-cold ones, and copying into cold memory makes
4 MiB transfers about 12% slower. And not while a grant waits for space.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from relayd_client.wire.framing import FREED_LINGER_MAX_BYTES

from .events import Freed


class FreedBatcher:
    """Freed lease ids pending per writer session, and when they go."""

    def __init__(self, linger: float, deliver: Callable[[str, Freed], None]) -> None:
        # Pending notices wait this long to be batched (0: sent at the end of each turn).
        self.linger = linger
        self.deliver = deliver  # (writer session id, its notice)
        self._ids: dict[str, list[int]] = {}
        self._bytes: dict[str, int] = {}  # the slot bytes they give back, by session
        self._timer: asyncio.TimerHandle | None = None

    def add(self, session_id: str, lease_id: int, nbytes: int) -> None:
        self._ids.setdefault(session_id, []).append(lease_id)
        self._bytes[session_id] = self._bytes.get(session_id, 0) + nbytes

    def pending(self, session_id: str) -> bool:
        return bool(self._ids.get(session_id))

    def drop(self, session_id: str) -> None:
        """Forget what is pending for a session that closed."""
        self._ids.pop(session_id, None)
        self._bytes.pop(session_id, None)

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
        """One Freed to each of ``session_ids`` (default: every session with notices pending)."""
        if session_ids is None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            session_ids = list(self._ids)
        for sid in session_ids:
            ids = self._ids.pop(sid, None)
            self._bytes.pop(sid, None)
            if ids:
                self.deliver(sid, Freed(tuple(ids)))
