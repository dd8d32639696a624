"""A RemoteTransport that moves bytes between regions of this one process.

For tests of what sits above a transport (the peer manager, pushes): it keeps
the contract of :mod:`relayd.transports.base` - the same lifecycle, the same
checks before anything moves, the same errors and the in-flight rule - with
``ctypes.memmove`` where Mooncake has the network. Endpoints that share a
:class:`Loopback` reach each other by session id; a session id no open
endpoint has is a peer that is gone.

What a test can make happen, each deterministic and without timing:

* :meth:`LoopbackTransport.fail_next`: the next transfers fail before any byte
  moves (``PullFailedError``, ``in_flight=False``), as against a peer that
  refuses;
* :meth:`LoopbackTransport.hold`: the next transfer waits at a :class:`Gate`
  with its bytes not yet moved. :meth:`Gate.entered` waits (bounded) until it
  is there; past the caller's timeout it raises ``PullTimeoutError`` with
  ``in_flight=True``, and the bytes still land when the gate opens, as a late
  Mooncake completion would. :meth:`Gate.release` lets it land or fail;
  ``close()`` of either end fails it without writing.

A remote range outside the peer's registered regions fails the transfer
(``PullFailedError``, ``in_flight=False``), as Mooncake's target refuses it;
the ops before it have landed by then, as with Mooncake.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import dataclasses
import itertools

from relayd.transports.base import (
    InFlight,
    MemoryRegion,
    PullError,
    PullFailedError,
    PullOp,
    PullTimeoutError,
    RemoteTransport,
    Transfer,
    TransportState,
    follow,
)


class Loopback:
    """The endpoints that can reach each other, by session id."""

    def __init__(self) -> None:
        self._endpoints: dict[str, LoopbackTransport] = {}
        self._ids = itertools.count(1)

    def transport(self) -> LoopbackTransport:
        """A new endpoint on this loopback (start it like any transport)."""
        return LoopbackTransport(self)

    def _join(self, endpoint: LoopbackTransport) -> str:
        session = f"loopback:{next(self._ids)}"
        self._endpoints[session] = endpoint
        return session

    def _leave(self, session: str) -> None:
        self._endpoints.pop(session, None)
        for endpoint in self._endpoints.values():
            endpoint._peer_left(session)

    def _reach(self, session: str) -> LoopbackTransport | None:
        endpoint = self._endpoints.get(session)
        return endpoint if endpoint is not None and endpoint.state is TransportState.OPEN else None


class Gate:
    """Where a held transfer waits; see :meth:`LoopbackTransport.hold`."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self._arrived = asyncio.Event()
        self._opened: asyncio.Future[str] = loop.create_future()

    async def entered(self, timeout: float) -> None:
        """Return once a transfer waits here; TimeoutError after ``timeout`` s."""
        await asyncio.wait_for(self._arrived.wait(), timeout)

    def release(self, *, fail: bool = False) -> None:
        """Let the held transfer land its bytes, or fail with nothing written."""
        self._open("failed" if fail else "")

    def _open(self, failure: str) -> None:
        if not self._opened.done():
            self._opened.set_result(failure)


@dataclasses.dataclass(eq=False)
class _Flight:
    ops: tuple[PullOp, ...]
    peer_session: str
    gate: Gate
    settled: asyncio.Future[None]


class LoopbackTransport(RemoteTransport):
    """One endpoint of a :class:`Loopback`."""

    def __init__(self, loopback: Loopback) -> None:
        super().__init__()
        self._loopback = loopback
        self._fail = 0
        self._gates: collections.deque[Gate] = collections.deque()
        self._flights: set[_Flight] = set()
        self.transfers = 0
        """Transfers whose bytes all landed."""

    async def start(self) -> None:
        self._begin_start()
        self._session = self._loopback._join(self)
        self._state = TransportState.OPEN

    async def register(self, region: MemoryRegion) -> None:
        self._require_open()
        self._regions.add(region)

    def fail_next(self, count: int = 1) -> None:
        """The next ``count`` transfers fail before moving a byte."""
        self._fail += count

    def hold(self) -> Gate:
        """The next transfer waits at the returned gate (several holds queue up)."""
        gate = Gate()
        self._gates.append(gate)
        return gate

    async def transfer(self, request: Transfer) -> None:
        self._require_open()
        ops = self._regions.check(request.ops) + self._regions.check(request.then)
        if not ops:
            return
        what = f"{request.verb} of {sum(op.length for op in ops)} B with {request.peer_session}"
        peer = self._loopback._reach(request.peer_session)
        if peer is None or self._fail:
            self._fail = max(self._fail - 1, 0)
            why = "is not reachable" if peer is None else "refused it"
            raise _failed(request, f"{what} failed: the peer {why}")
        if not self._gates:
            self._move(peer, ops, request)
            return
        loop = asyncio.get_running_loop()
        gate = self._gates.popleft()
        flight = _Flight(ops, request.peer_session, gate, loop.create_future())
        self._flights.add(flight)
        task = loop.create_task(self._when_open(flight, peer, request))
        gate._arrived.set()
        try:
            finished, _ = await asyncio.wait((task,), timeout=max(request.timeout, 0.0))
        except asyncio.CancelledError:
            task.add_done_callback(_consume)  # in flight until the gate opens
            raise
        if finished:
            task.result()
            return
        task.add_done_callback(_consume)
        why = f"{what} did not finish within {request.timeout:g}s; still in flight"
        raise request.error(PullTimeoutError, why, in_flight=True, settled=follow(flight.settled))

    def _in_flight(self) -> list[InFlight]:
        return [(f.ops, f.settled) for f in self._flights]

    async def close(self) -> None:
        if self._state is TransportState.OPEN:
            self._loopback._leave(self._session)
        self._state = TransportState.CLOSED
        for gate in [f.gate for f in self._flights] + list(self._gates):
            gate._open("the transport was closed")
        self._gates.clear()
        self._regions.take_all()

    def _peer_left(self, session: str) -> None:
        # As Mooncake fails a transfer at once when its peer's connection drops.
        for flight in self._flights:
            if flight.peer_session == session:
                flight.gate._open("the peer went away")

    async def _when_open(self, flight: _Flight, peer: LoopbackTransport, request: Transfer) -> None:
        try:
            failure = await flight.gate._opened
            # A gate opened in the turn that closed us: close() has promised no more writes.
            if not failure and self._state is not TransportState.OPEN:
                failure = "the transport was closed"
            if not failure and self._loopback._reach(request.peer_session) is not peer:
                failure = "the peer went away"
            if failure:
                why = f"{request.verb} with {request.peer_session} failed: {failure}"
                raise _failed(request, why)
            self._move(peer, flight.ops, request)
        finally:
            self._flights.discard(flight)
            flight.settled.set_result(None)

    def _move(self, peer: LoopbackTransport, ops: tuple[PullOp, ...], request: Transfer) -> None:
        for op in ops:
            if not peer._regions.holds(op.remote_addr, op.length):
                why = f"{request.verb} op {op} failed: the peer has no registered region there"
                raise _failed(request, why)
            if request.write:
                ctypes.memmove(op.remote_addr, op.local_addr, op.length)
            else:
                ctypes.memmove(op.local_addr, op.remote_addr, op.length)
        self.transfers += 1


def _failed(request: Transfer, message: str) -> PullError:
    """A failure with nothing left in flight."""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    done.set_result(None)
    return request.error(PullFailedError, message, in_flight=False, settled=done)


def _consume(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # the caller was told already; the outcome is only the quarantine's


__all__ = ["Gate", "Loopback", "LoopbackTransport"]
