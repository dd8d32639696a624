"""Per-peer credits: a bound on cross-node pulls in flight to each peer daemon.

The router takes a credit of the peer before it starts a pull and gives it back
when nothing of that pull is in flight any more::

    async with pool.acquire(peer, timeout=deadline_left) as credit:
        try:
            await transport.pull(session, ops, timeout=deadline_left)
        except PullError as exc:
            if exc.in_flight:
                credit.release_when(exc.settled)  # keep it until the bytes stop
            raise

Guarantees:

* never more than ``capacity(peer)`` credits of a peer are out;
* waiters are served first come, first served: a credit given back goes
  straight to the oldest waiter, and a newcomer never overtakes a waiter;
* a credit comes back when the ``async with`` block exits by any route
  (return, exception, cancellation), including a task cancelled in the instant
  between being handed a credit and resuming;
* a wait that runs past ``timeout`` raises ResourceExhaustedError and leaves
  the queue as if the waiter had never come.

One event loop only; not thread-safe.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from relayd_client.wire.errors import InvalidArgumentError, ResourceExhaustedError


@dataclasses.dataclass(frozen=True)
class PeerCredits:
    """One peer's credits at a moment (for status and the metrics collector)."""

    capacity: int
    in_use: int
    waiting: int


class _Peer:
    __slots__ = ("capacity", "in_use", "waiters")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()


class Credit:
    """One credit of one peer, out until released."""

    __slots__ = ("_handed_off", "_pool", "_released", "peer")

    def __init__(self, pool: CreditPool, peer: str) -> None:
        self._pool = pool
        self.peer = peer
        self._released = False
        self._handed_off = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Give the credit back (idempotent)."""
        if not self._released:
            self._released = True
            self._pool._release(self.peer)

    def release_when(self, done: asyncio.Future[Any]) -> None:
        """Keep the credit past the ``async with`` block, until ``done`` is done."""
        self._handed_off = True
        done.add_done_callback(lambda _: self.release())


class _Acquire:
    """``async with pool.acquire(peer, timeout) as credit``."""

    __slots__ = ("_credit", "_peer", "_pool", "_timeout")

    def __init__(self, pool: CreditPool, peer: str, timeout: float) -> None:
        self._pool = pool
        self._peer = peer
        self._timeout = timeout
        self._credit: Credit | None = None

    async def __aenter__(self) -> Credit:
        await self._pool._take(self._peer, self._timeout)
        self._credit = Credit(self._pool, self._peer)
        return self._credit

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        credit = self._credit
        if credit is not None and not credit._handed_off:
            credit.release()


class CreditPool:
    """Credits per peer, ``capacity`` each unless ``per_peer`` says otherwise."""

    def __init__(self, capacity: int, *, per_peer: Mapping[str, int] | None = None) -> None:
        if capacity <= 0 or any(n <= 0 for n in (per_peer or {}).values()):
            raise InvalidArgumentError("credit capacities must be positive")
        self._default = capacity
        self._per_peer = dict(per_peer or {})
        self._peers: dict[str, _Peer] = {}

    def acquire(self, peer: str, timeout: float) -> _Acquire:
        """Wait (FIFO, at most ``timeout`` seconds) for a credit of ``peer``."""
        return _Acquire(self, peer, timeout)

    def try_acquire(self, peer: str) -> Credit | None:
        """A credit of ``peer`` now, or None when all are out or somebody waits
        (a push that finds none falls back to the reader's pull)."""
        state = self._state(peer)
        if state.in_use >= state.capacity or state.waiters:
            return None
        state.in_use += 1
        return Credit(self, peer)

    def capacity(self, peer: str) -> int:
        return self._per_peer.get(peer, self._default)

    def in_use(self, peer: str) -> int:
        state = self._peers.get(peer)
        return state.in_use if state else 0

    def waiting(self, peer: str) -> int:
        state = self._peers.get(peer)
        return len(state.waiters) if state else 0

    def stats(self) -> dict[str, PeerCredits]:
        """Every peer seen so far."""
        return {
            peer: PeerCredits(s.capacity, s.in_use, len(s.waiters))
            for peer, s in sorted(self._peers.items())
        }

    def _state(self, peer: str) -> _Peer:
        state = self._peers.get(peer)
        if state is None:
            state = self._peers[peer] = _Peer(self.capacity(peer))
        return state

    async def _take(self, peer: str, timeout: float) -> None:
        state = self._state(peer)
        # A free credit means no live waiter: _release hands credits straight to the
        # oldest waiter, so a newcomer can never overtake one.
        if state.in_use < state.capacity:
            state.in_use += 1
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        state.waiters.append(waiter)
        timer = loop.call_later(max(timeout, 0.0), _expire, waiter, peer, state, timeout)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                # Handed a credit, then cancelled before resuming: pass it on.
                self._release(peer)
            elif waiter in state.waiters:
                state.waiters.remove(waiter)
            raise
        finally:
            timer.cancel()

    def _release(self, peer: str) -> None:
        state = self._peers[peer]
        while state.waiters:
            waiter = state.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the credit moves over; in_use is unchanged
                return
        state.in_use -= 1


def _expire(waiter: asyncio.Future[None], peer: str, state: _Peer, timeout: float) -> None:
    if waiter.done():
        return
    if waiter in state.waiters:
        state.waiters.remove(waiter)
    waiter.set_exception(
        ResourceExhaustedError(
            f"no credit for peer {peer} within {timeout:g}s "
            f"({state.in_use} of {state.capacity} pulls in flight)"
        )
    )
