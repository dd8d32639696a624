"""Freed notices: telling a writer which of its leases' slots it may reuse, batched.

A writer needs Freed only to reuse the slots of grants it holds, and it holds
several idle grants' worth; a writer that runs short asks for a grant, which
sends its notices at once (:meth:`FreedBatcher.send` from the grant queue).
So they can wait: batching turns one wakeup of the writer (and a send here)
per transfer into one per linger. Not once a writer's pending notices give
back :data:`FREED_LINGER_MAX_BYTES`, though: a writer that cannot reuse the
slots it just wrote takes cache-cold ones, and copying into cold memory makes
4 MiB transfers about 12% slower. And not while a grant waits for space.
Nor when the writer has been quiet: a Freed owed to a writer that was owed
nothing for :data:`FREED_IDLE_S` goes at the end of this turn, since nothing
is likely to join it, and the writer's next lease (cut LIFO) then lands in
the run it wrote last, still in cache, instead of a cold one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

from .events import Freed

# Freed notices that would return this much arena to a writer go at once, not
# after the linger; as the client's LINGER_MAX_BYTES.
FREED_LINGER_MAX_BYTES = 2 << 20
# A writer owed nothing for this long is quiet: its next Freed goes at once.
# Well below the linger, so that a busy writer (frees every few hundred us)
# still gets one notice per batch, and a paced one (one free every 10-20 ms)
# gets each lease back before its next put.
FREED_IDLE_S = 0.005


class FreedBatcher:
    """Freed lease ids pending per writer session, and when they go."""

    def __init__(
        self,
        linger: float,
        deliver: Callable[[str, Freed], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # Pending notices wait this long to be batched (0: sent at the end of each turn).
        self.linger = linger
        self.deliver = deliver  # (writer session id, its notice)
        self.clock = clock
        self._ids: dict[str, list[int]] = {}
        self._bytes: dict[str, int] = {}  # the slot bytes they give back, by session
        self._owed_at: dict[str, float] = {}  # when each writer was last owed a notice
        self._quiet: set[str] = set()  # writers owed one after a quiet spell: due now
        self._timer: asyncio.TimerHandle | None = None

    def add(self, session_id: str, lease_id: int, nbytes: int) -> None:
        now = self.clock()
        last = self._owed_at.get(session_id)
        self._owed_at[session_id] = now
        if last is not None and now - last >= FREED_IDLE_S:
            # A writer seen before, quiet since: a writer never owed anything
            # yet may be starting a burst, so its first notice lingers.
            self._quiet.add(session_id)
        self._ids.setdefault(session_id, []).append(lease_id)
        self._bytes[session_id] = self._bytes.get(session_id, 0) + nbytes

    def pending(self, session_id: str) -> bool:
        return bool(self._ids.get(session_id))

    def drop(self, session_id: str) -> None:
        """Forget what is pending for a session that closed."""
        self._ids.pop(session_id, None)
        self._bytes.pop(session_id, None)
        self._owed_at.pop(session_id, None)
        self._quiet.discard(session_id)

    def flush(self, *, space_short: bool) -> None:
        """Send what is due now; arm the linger for the rest."""
        if self.linger <= 0 or space_short:
            self.send()
            return
        due = [sid for sid, n in self._bytes.items() if n >= FREED_LINGER_MAX_BYTES]
        if self._quiet:
            due.extend(self._quiet.difference(due))
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
            self._quiet.discard(sid)
            if ids:
                self.deliver(sid, Freed(tuple(ids)))
