"""The contract between the daemon and a cross-node transport backend.

A backend moves bytes between this daemon's registered memory and a peer
daemon's registered memory. It knows nothing about leases, slots, requests or
DataRefs: the router above it decides *what* to move and *where*; the backend
only moves it and reports, without ambiguity, whether the local bytes may still
change.

Who calls what, when, how often, on which thread
-------------------------------------------------

Every method is called from the daemon's event-loop thread. A backend is not
thread-safe and must never block that thread: anything that can block (native
initialisation, memory registration, handshakes, busy-waits) runs on the
backend's own bounded worker threads.

``start()``
    By the daemon lifecycle, once, during start-up (after preflight). Loads
    the native library, creates the engine and makes the local endpoint
    reachable. Raises a :class:`~relayd_client.wire.errors.RelayError` whose
    message says what to fix.

``register(region)``
    By the pool layer, right after ``start()``, once per memory region it will
    pull into or serve from (e.g. each SHM arena segment). Regions stay
    registered until ``close()``; there is no per-transfer registration.

``session_id``
    By the daemon after ``start()``, to advertise this endpoint to peers (it
    goes into ``DataRef.origin.mooncake_session`` and the Peer handshake).
    Stable for the life of this object; a restarted daemon has a new one.

``pull(peer_session, ops, timeout=...)``
    By the router, on the reader's node, once per cross-node transfer (one
    logical transfer = one call, all of its ops batched), typically tens of
    times per second per request stream. The caller holds a credit of that peer
    (:class:`relayd.transports.credits.CreditPool`) for as long as the pull is
    in flight, which bounds concurrent pulls per peer.

``wait_settled(ops)``
    By the pool layer before it reuses a local run whose pull was cancelled
    (``abort``, drain). Rare.

``close()``
    By the daemon lifecycle, once, at shutdown (idempotent). Unregisters the
    regions and tears the engine down. After ``close()`` nothing the backend
    started can write into local memory any more.

The in-flight rule
------------------

A pull that ends in an error may have left bytes in flight: the backend cannot
always cancel a transfer it has handed to the native engine, and a late
completion would write into the local run. So every pull ends in one of:

* it returns: every op reached a terminal state and succeeded;
* it raises :class:`PullFailedError` or :class:`PullTimeoutError` with
  ``in_flight=False``: nothing can write into the local ranges any more, the
  run may be reused at once;
* it raises one of them with ``in_flight=True``: the local ranges are
  *quarantined* until ``error.settled`` is done (it never fails). Keep the
  local run (and the peer's credit, see ``Credit.release_when``) until then.

If ``pull()`` itself is cancelled, its ops may be in flight too; the caller
uses ``await transport.wait_settled(ops)`` before reusing those ranges. A pull
that ``close()`` interrupts raises PullFailedError, by the same rule; ``close()``
lifts every quarantine once the engine is gone.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import enum
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import NamedTuple

from relayd_client.wire.errors import (
    InternalError,
    InvalidArgumentError,
    PeerUnavailableError,
    RelayError,
    RelayTimeoutError,
    SessionClosedError,
)


class TransferState(enum.Enum):
    """State of one op handed to a backend.

    ``DONE`` and ``FAILED`` are terminal: nothing more will be written. ``PENDING``
    and ``TIMEOUT`` are not: a ``TIMEOUT`` is the engine saying "slow", the bytes
    may still land, so the op is still in flight.
    """

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    TIMEOUT = "timeout"

    @property
    def terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


class TransportState(enum.Enum):
    """Lifecycle of a backend; a closed backend cannot be reopened."""

    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"


@dataclasses.dataclass(frozen=True)
class MemoryRegion:
    """A range of this process's address space, registered once for transfers."""

    name: str
    base: int
    length: int

    def __post_init__(self) -> None:
        if self.base <= 0 or self.length <= 0:
            raise ValueError(f"memory region {self.name!r} needs base > 0 and length > 0")

    @property
    def end(self) -> int:
        return self.base + self.length

    def contains(self, addr: int, length: int) -> bool:
        return self.base <= addr and addr + length <= self.end


class PullOp(NamedTuple):
    """Copy ``length`` bytes from the peer's ``remote_addr`` to our ``local_addr``."""

    local_addr: int
    remote_addr: int
    length: int


#: A large transfer goes as several ops of at most this many bytes, so that the
#: engine can spread it over its lanes.
OP_BYTES = 8 << 20


def split_ops(local_addr: int, remote_addr: int, nbytes: int) -> list[PullOp]:
    """The ops that move ``nbytes`` between ``local_addr`` and ``remote_addr``."""
    return [
        PullOp(local_addr + done, remote_addr + done, min(OP_BYTES, nbytes - done))
        for done in range(0, nbytes, OP_BYTES)
    ]


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One ``pull()`` or ``push()`` call, as a backend's :meth:`RemoteTransport.transfer`
    receives it; ``ops`` and ``then`` not yet checked."""

    peer_session: str
    ops: Sequence[PullOp]
    then: Sequence[PullOp]
    timeout: float
    write: bool = False
    """A push: the ops copy local ranges into the peer's (a WRITE)."""

    @property
    def verb(self) -> str:
        return "push" if self.write else "pull"

    def error(
        self,
        cls: type[PullError],
        message: str,
        *,
        in_flight: bool,
        settled: asyncio.Future[None],
    ) -> PullError:
        """``cls`` (PullFailedError or PullTimeoutError) for this transfer."""
        return cls(message, peer_session=self.peer_session, in_flight=in_flight, settled=settled)


class Regions:
    """The memory regions a backend registered, and the checks every op passes
    before anything is submitted."""

    def __init__(self) -> None:
        self._regions: list[MemoryRegion] = []

    def __iter__(self) -> Iterator[MemoryRegion]:
        return iter(self._regions)

    def check_new(self, region: MemoryRegion) -> None:
        for other in self._regions:
            if region.base < other.end and other.base < region.end:
                raise InvalidArgumentError(f"region {region.name!r} overlaps {other.name!r}")

    def add(self, region: MemoryRegion) -> None:
        self.check_new(region)
        self._regions.append(region)

    def take_all(self) -> list[MemoryRegion]:
        """Every region, forgotten here (to unregister them)."""
        regions, self._regions = self._regions, []
        return regions

    def holds(self, addr: int, length: int) -> bool:
        return any(r.contains(addr, length) for r in self._regions)

    def check(self, ops: Sequence[PullOp]) -> tuple[PullOp, ...]:
        """``ops`` as PullOps whose local ranges lie in these regions, or InvalidArgumentError."""
        try:
            checked = tuple(PullOp(*map(int, op)) for op in ops)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"pull ops must be (local, remote, length): {exc}") from exc
        for op in checked:
            if op.length <= 0 or op.remote_addr <= 0:
                raise InvalidArgumentError(f"bad pull op {op}: length and address must be > 0")
            if not self.holds(op.local_addr, op.length):
                raise InvalidArgumentError(f"pull op {op} writes outside every registered region")
        return checked


InFlight = tuple[Sequence[PullOp], asyncio.Future[None]]
"""A transfer that may still write: its ops and its (internal) settled future."""


def overlaps(a: Sequence[PullOp], b: Sequence[PullOp]) -> bool:
    """Whether a local range of ``a`` overlaps one of ``b``."""
    return any(
        x.local_addr < y.local_addr + y.length and y.local_addr < x.local_addr + x.length
        for x in a
        for y in b
    )


def follow(settled: asyncio.Future[None]) -> asyncio.Future[None]:
    """A future done when ``settled`` is: what a PullError hands out, so that
    cancelling a wait on it harms nobody else."""
    copy: asyncio.Future[None] = settled.get_loop().create_future()

    def _done(_: asyncio.Future[None]) -> None:
        if not copy.done():
            copy.set_result(None)

    settled.add_done_callback(_done)
    return copy


class PullError(RelayError):
    """A pull that did not succeed, and what it says about its local ranges.

    Never raised itself: catch it to handle both subclasses (see "The in-flight rule").
    """

    in_flight: bool
    """True: bytes may still land in the local ranges until ``settled`` is done."""
    settled: asyncio.Future[None]
    """Done (never with an error) once nothing can write into the local ranges.
    Each error has its own future, so cancelling a wait on it harms nobody."""
    peer_session: str

    def __init__(
        self, message: str, *, peer_session: str, in_flight: bool, settled: asyncio.Future[None]
    ) -> None:
        super().__init__(message)
        self.peer_session = peer_session
        self.in_flight = in_flight
        self.settled = settled


class PullFailedError(PullError, PeerUnavailableError):
    """The peer failed the transfer: it is gone, refused us, or the remote range is not
    registered there."""


class PullTimeoutError(PullError, RelayTimeoutError):
    """The pull did not reach a terminal state before its deadline."""


class TransportUnavailableError(InternalError):
    """A transport backend cannot run on this host (package or system library missing,
    requested hardware absent); the message says what to install or change."""


class RemoteTransport(abc.ABC):
    """A cross-node transport backend; see the module docstring for the contract.

    The lifecycle state, the session id and the registered regions are kept
    here, the same for every backend; a backend's ``start()`` begins with
    :meth:`_begin_start` and ends by setting ``_session`` and ``_state``.
    """

    def __init__(self) -> None:
        self._state = TransportState.UNOPENED
        self._session = ""
        self._regions = Regions()

    @property
    def state(self) -> TransportState:
        return self._state

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the engine and open the local endpoint. Once."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Unregister everything and tear the engine down. Idempotent."""

    @abc.abstractmethod
    async def register(self, region: MemoryRegion) -> None:
        """Make ``region`` usable as a pull destination and as a source for peers."""

    @property
    def session_id(self) -> str:
        """What peers pass as ``peer_session`` to reach this endpoint."""
        self._require_open()
        return self._session

    async def pull(
        self,
        peer_session: str,
        ops: Sequence[PullOp],
        *,
        timeout: float,
        then: Sequence[PullOp] = (),
    ) -> None:
        """Copy every op's remote range from ``peer_session`` into local memory.

        ``then`` ops start only once every op of ``ops`` has landed (read a flag
        after the data it guards), within the same call and ``timeout``; if
        ``ops`` fail, ``then`` never starts.

        Raises PullFailedError, PullTimeoutError (both with ``in_flight``),
        InvalidArgumentError (an op is malformed or outside the registered
        regions; nothing was submitted).
        """
        await self.transfer(Transfer(peer_session, ops, then, timeout))

    async def push(self, peer_session: str, ops: Sequence[PullOp], *, timeout: float) -> None:
        """Copy every op's *local* range into the peer's remote range (a WRITE).

        The same contract as :meth:`pull` with the roles of the ranges swapped:
        it returns once the peer has applied every op; an error with
        ``in_flight=True`` means the local ranges may still be read, and the
        remote ones written, until ``settled``.
        """
        await self.transfer(Transfer(peer_session, ops, (), timeout, write=True))

    @abc.abstractmethod
    async def transfer(self, request: Transfer) -> None:
        """The backend's part of :meth:`pull` and :meth:`push`, with their contract."""

    async def wait_settled(self, ops: Sequence[PullOp]) -> None:
        """Return once no earlier pull can write into any of ``ops``' local ranges."""
        pending = [settled for mine, settled in self._in_flight() if overlaps(mine, ops)]
        if pending:
            await asyncio.shield(asyncio.gather(*pending))

    @abc.abstractmethod
    def _in_flight(self) -> Iterable[InFlight]:
        """Each transfer that may still write."""

    def _begin_start(self) -> None:
        """``start()`` runs once; until it succeeds the transport counts as closed, so
        a failed start is final."""
        if self._state is not TransportState.UNOPENED:
            name = type(self).__name__
            raise InternalError(f"{name}.start() on a {self._state.value} transport")
        self._state = TransportState.CLOSED

    def _require_open(self) -> None:
        if self._state is not TransportState.OPEN:
            raise SessionClosedError(f"the {type(self).__name__} is {self._state.value}")

    async def __aenter__(self) -> RemoteTransport:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
