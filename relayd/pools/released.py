"""Release rings: the Releases readers write into memory, taken when the daemon is awake anyway.

A Release frame wakes the daemon, and a wake-up, cache-cold, costs it more CPU
than the notices it carries. Nobody waits for a Release, though: only a writer
short of space needs the slots back (a writer takes a run back on its reader's
read mark in the slot header, not on the daemon's Freed). So a session
that took a Release ring (:mod:`relayd_client.wire.rings`) writes its other
Releases there, and the daemon takes them:

- after each session frame it handles (the writer's Publish frames come at
  least as often as a reader's Release frames would), after that frame's own
  notices, so a Release finds the Publish it follows;
- before a grant request decides whether the writer must wait for space;
- when the session closes, before what it leaves is reclaimed: a Release it
  wrote before it died is a Release, not a death;
- on a timer while any lease is out, so a lease read last in a burst does not
  stay in the books: twice the writers' linger
  (:data:`~relayd_client.wire.framing.NOTICE_LINGER_S`) after the last read
  while rings hold Releases, backing off to :data:`IDLE_TICK_S` while they stay
  empty (a lease nobody reads yet must not keep the daemon waking 40 times a
  second until its TTL). A turn on a session frame reads every ring and puts
  the timer off (:meth:`ReleaseRings.schedule`), so while frames come more
  often than the timer would, it never wakes the daemon (in a stop-and-wait
  run at 16 MiB that took its wake-ups from 1.3 to 1.07 a transfer, and its
  CPU 2-5% down). Not once the linger: a busy writer's frames come a linger
  and its next put apart, so a timer of one linger, put off by each, still
  came just before every frame (at 16 MiB, stop-and-wait, twice the linger
  took the daemon's wake-ups from 0.18-0.26 a transfer to 0.11-0.18).

- before a frame of the same session is judged for its Claims and Releases:
  the session wrote the ring first, and a claim must not trade places with
  the release that follows it;
- before the TTL sweep: a lease claimed there is being read, not forgotten.

A word with :data:`~relayd_client.wire.rings.CLAIM_BIT` set is a Claim (a
reader about to copy a large lease). Each id is judged exactly as a Claim or
Release notice of that session would be (the same :meth:`LeaseTable.claim`
and :meth:`LeaseTable.release`); the ring is the client's to write, so an id
in it is as hostile as a notice. One that breaks a rule of the lease table
ends that session's ring (the session is told; its later Releases are lost to
it, as a session's frames are when it sends a bad one), and never reaches the
frame being handled for another session.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from relayd_client.wire.errors import RelayError
from relayd_client.wire.rings import CLAIM_BIT, IdRing

from .sessions import Session, Sessions

log = logging.getLogger(__name__)

# The longest the timer waits while the rings stay empty.
IDLE_TICK_S = 1.0


class ReleaseRings:
    """Every session's Release ring, and when they are read."""

    def __init__(
        self,
        sessions: Sessions,
        release: Callable[[Session, int, int], None],
        claim: Callable[[Session, int, int], object],
        *,
        outstanding: Callable[[], bool],
        after: Callable[[], None],
        linger: float,
    ) -> None:
        self._sessions = sessions
        self._release = release  # (reader session, lease id, generation): a Release notice
        self._claim = claim  # the same for a Claim notice
        self._outstanding = outstanding  # whether any lease is out (the timer runs only then)
        self._after = after  # what follows a timed read: sending the Freed it caused
        self._flowing = 2 * linger  # the timer's wait while Releases flow (see the module)
        self._interval = self._flowing  # its next wait: doubles while rings stay empty
        self._rings: dict[str, IdRing] = {}
        self._timer: asyncio.TimerHandle | None = None
        # Releases taken, by the way they came (metrics read them).
        self.by_ring = 0
        self.by_frame = 0

    def attach(self, session_id: str, ring: IdRing) -> None:
        """``session_id`` writes its Releases into ``ring`` from now on."""
        self.detach(session_id)
        self._rings[session_id] = ring

    def detach(self, session_id: str) -> None:
        ring = self._rings.pop(session_id, None)
        if ring is not None:
            ring.close()

    def take_all(self) -> int:
        """Judge what every ring holds; how many ids that was."""
        return sum(self.take(session_id) for session_id in list(self._rings))

    def take(self, session_id: str) -> int:
        """Judge what ``session_id``'s ring holds (a turn's worth at most); how many ids."""
        ring = self._rings.get(session_id)
        session = self._sessions.get(session_id)
        if ring is None or session is None or not ring.ready():
            return 0
        ids = ring.take()
        self._interval = self._flowing  # Releases flow: the timer keeps up again
        for word in ids:
            try:
                if word & CLAIM_BIT:
                    lease_id = word ^ CLAIM_BIT
                    self._claim(session, lease_id, lease_id)
                else:
                    self.by_ring += 1
                    self._release(session, word, word)
            except RelayError as err:  # a rule of the lease table: this session's ring ends
                session.refuse(err.code, f"Release ring closed: {err}")
                self.detach(session_id)
                break
            except Exception:  # a bug: it ends this ring, never the caller's turn
                log.exception("a Release from a ring failed", extra={"session_id": session_id})
                self.detach(session_id)
                break
        return len(ids)

    def schedule(self, *, restart: bool = False) -> None:
        """Arm the timer if rings are attached and some lease may still be released.

        ``restart``: every ring was just read, so a timer already armed starts
        over - once it is due within half its wait: re-arming it on every frame
        cost a daemon turn more than the check (~2.5 us warm, many times that
        cache-cold) where a frame comes every transfer.
        """
        timer = self._timer
        if restart and timer is not None:
            if timer.when() - asyncio.get_running_loop().time() > self._interval / 2:
                return
            timer.cancel()
            self._timer = None
        if self._timer is None and self._rings and self._outstanding():
            self._timer = asyncio.get_running_loop().call_later(self._interval, self._tick)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for session_id in list(self._rings):
            self.detach(session_id)

    def _tick(self) -> None:
        self._timer = None
        try:
            if not self.take_all():
                self._interval = min(self._interval * 2, IDLE_TICK_S)
            self._after()
        except Exception:  # the daemon's own bookkeeping: log, never end the loop
            log.exception("taking Release rings failed")
        self.schedule()
