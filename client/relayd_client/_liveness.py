"""Whether the daemon still answers on the session socket, watched while a call waits.

Keyed puts and takes, discards and cross-node fetches wait for their answer on
the session socket, where the gRPC channel's keepalive does not reach. A daemon
that froze (stopped, its host stalled) keeps the socket open and ends nothing:
such a call would wait out its whole timeout, a take maybe minutes. So
:class:`Liveness` keeps the gRPC channel's rule on this socket too, with its
numbers (:mod:`relayd_client.wire.keepalive`): while a call waits and the
daemon has sent nothing for ``KEEPALIVE_MS``, probe it; when nothing comes
within ``KEEPALIVE_TIMEOUT_MS`` of the probe, take the daemon for gone.

- Any frame from the daemon is a sign of life, not only the probe's answer: a
  daemon that talks anyway is never probed.
- Silence counts from the last frame read or from when the watch began (a
  call went out while none waited), whichever is later.
- No call waiting, no probe and no timer: an idle client never wakes the daemon.
- Only a daemon whose BOUND event sets ``answers_probes`` is probed. An older
  one skips the unknown field and answers nothing, so a live one would be taken
  for gone: its calls wait their own timeouts, as they always did.

A probe that goes unanswered fails the waiting calls (DaemonUnavailableError)
and ends the connection, as a daemon that hung up would; the client re-attaches
(see :meth:`SessionChannel._unanswered`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .wire import keepalive


class Liveness:
    """The watch over one session connection; every method runs on its loop.

    ``waiting``: whether a call waits for its answer now. ``probe``: send a
    probe at once. ``dead``: the daemon did not answer one (why, in words).
    """

    def __init__(
        self,
        waiting: Callable[[], bool],
        probe: Callable[[], None],
        dead: Callable[[str], None],
    ) -> None:
        self._waiting = waiting
        self._probe = probe
        self._dead = dead
        self._loop: asyncio.AbstractEventLoop | None = None  # set: the daemon answers probes
        self._timer: asyncio.TimerHandle | None = None  # set while a call waits, or a probe does
        self._quiet_since = 0.0  # loop time of the last frame in, or of the first call out
        self._probed_at: float | None = None  # a probe nothing has answered yet
        self.probes = 0  # probes sent on this connection

    def enable(self, loop: asyncio.AbstractEventLoop) -> None:
        """The daemon said it answers probes (its BOUND event)."""
        self._loop = loop

    def stop(self) -> None:
        """The connection ended: no more probes."""
        self._loop = None
        self._probed_at = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def call_out(self) -> None:
        """A call went out: watch, unless the watch is on already."""
        loop = self._loop
        if loop is None or self._timer is not None:
            return
        self._quiet_since = loop.time()
        self._timer = loop.call_at(self._quiet_since + _keepalive_s(), self._check)

    def heard(self) -> None:
        """A frame came from the daemon."""
        if self._timer is not None:  # nobody asks when the silence began otherwise
            assert self._loop is not None
            self._quiet_since = self._loop.time()
            self._probed_at = None

    def _check(self) -> None:
        self._timer = None
        loop = self._loop
        if loop is None:
            return
        if self._probed_at is not None:
            # Nothing at all came since the probe (a frame clears it). Gone even
            # if the calls ended meanwhile: the next one would wait in vain.
            self._probed_at = None
            self._dead(
                f"relayd answered no liveness probe on the session socket within "
                f"{keepalive.KEEPALIVE_TIMEOUT_MS / 1000:.3g}s, after "
                f"{keepalive.KEEPALIVE_MS / 1000:.3g}s of silence while a call waited"
            )
            return
        if not self._waiting():
            return  # idle: the next call starts the watch again
        now = loop.time()
        due = self._quiet_since + _keepalive_s()
        if now < due:  # heard from meanwhile
            self._timer = loop.call_at(due, self._check)
            return
        self._probed_at = now
        self.probes += 1
        self._timer = loop.call_at(now + keepalive.KEEPALIVE_TIMEOUT_MS / 1000, self._check)
        self._probe()


def _keepalive_s() -> float:
    # Read at each use, not imported: tests shorten the module's numbers.
    return keepalive.KEEPALIVE_MS / 1000
