"""Sessions, grants and leases: the daemon's single source of truth for who holds what.

Who calls what, and when (all on the daemon's event loop, never from threads):

* ``open_session`` - once per client, from the gRPC ``Attach`` handler.
* ``bind``/``close_session`` - when the client's session socket connects /
  hits EOF. EOF is how session death is detected: a SIGKILLed client's socket
  closes at once, no timeout involved.
* ``grant`` - from the gRPC ``Grant`` handler, a few times per session (a grant
  serves many leases); it may wait, fairly, for space.
* ``on_reserve``/``on_publish``/``on_claim``/``on_release``/``on_cancel`` - per
  transfer, from session frames; O(1) each, no allocation in the arena.
* ``abort`` - from the gRPC ``Abort`` handler.
* ``reap`` - from the daemon's housekeeping loop, every ``HOUSEKEEPING_INTERVAL`` (TTL).

A writer sub-allocates leases inside its grants without asking the daemon;
the daemon learns of each lease from the ``Reserve``/``Publish`` notices and
tells the writer, in a ``Freed`` notice, when a lease's slots may be reused.
When the writer's session ends its grants become *orphans*: unpublished
leases are dropped, the unused parts go back to the arena at once, and each
published lease returns its own run to the arena when it is read, expires or
is aborted.

Pools: the SHM arena and, on GPU nodes, one slot pool per GPU
(:mod:`relayd.pools.cuda`). Every rule here - grants, generations, TTL,
fair backpressure, reclaim on session death - is the same for all of them;
a grant names its pool, and a run remembers which pool it came from, so a
lease is freed into the allocator it was cut from.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import logging
import secrets
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Protocol

from relayd_client.wire.errors import (
    AbortedError,
    DrainingError,
    InvalidArgumentError,
    PermissionDeniedError,
    RelayError,
    ResourceExhaustedError,
    SessionClosedError,
)
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.transport import Transport

from .arena import Arena, Run

log = logging.getLogger(__name__)

GEN_SHIFT = 32
BIND_DEADLINE = 10.0
REQUEST_MEMORY = 300.0
# ... but no more than this many records of requests with no lease left: at
# thousands of requests a second, 300 s of them would be hundreds of MB.
MAX_REQUEST_RECORDS = 1 << 16
# Claims and releases held for leases whose Publish has not arrived yet: in
# all, for one lease, and from one session for one lease (a reader sends a
# claim and a release; two reads of one DataRef racing in one process, twice
# that). A session past its share is misbehaving and is closed.
MAX_EARLY = 1 << 16
MAX_EARLY_PER_LEASE = 8
MAX_EARLY_PER_SESSION = 4
# Abort tombstones of requests nobody wrote yet are the one record a client can
# create without holding memory; cap them so Abort cannot grow the daemon.
MAX_TOMBSTONES = 1 << 14
# Freed notices that would return this much arena to a writer go at once, not
# after the linger (see LeaseManager.flush); as the client's LINGER_MAX_BYTES.
FREED_LINGER_MAX_BYTES = 2 << 20


# The longest a dead GPU writer's runs wait for it to finish exiting.
GPU_FENCE_LIMIT_S = 60.0


class LeaseState(enum.Enum):
    RESERVED = pb.LEASE_STATE_RESERVED
    PUBLISHED = pb.LEASE_STATE_PUBLISHED
    CLAIMED = pb.LEASE_STATE_CLAIMED


class ReclaimReason(enum.Enum):
    WRITER_DIED = "writer_died"
    READER_DIED = "reader_died"
    TTL = "ttl"
    ABORT = "abort"
    DRAIN = "drain"


class SessionState(enum.Enum):
    PENDING = "pending"
    BOUND = "bound"
    CLOSED = "closed"


Sink = Callable[[pb.SessionFrame], None]


class Pool(Protocol):
    """What the lease rules need of a pool of slots (the arena, a GPU pool)."""

    name: str
    slot_size: int

    @property
    def capacity_bytes(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    def largest_free_run(self) -> int: ...
    def max_run_slots(self) -> int: ...
    def allocate(self, nslots: int) -> Run | None: ...
    def free(self, run: Run) -> None: ...
    def clear_header(self, segment: int, slot: int) -> None: ...


@dataclasses.dataclass(eq=False)
class Session:
    id: str
    token: bytes
    pid: int
    stages: tuple[str, ...]
    created: float
    namespaces: dict[str, str] = dataclasses.field(default_factory=dict)
    gpu_uuids: tuple[str, ...] = ()
    uid: int = -1
    gid: int = -1
    state: SessionState = SessionState.PENDING
    sink: Sink | None = None
    grants: dict[int, Grant] = dataclasses.field(default_factory=dict)
    claimed: set[int] = dataclasses.field(default_factory=set)
    granted_slots: int = 0  # all pools (they share one slot size)
    pool_slots: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(eq=False)
class Grant:
    id: int
    session_id: str
    run: Run
    leases: dict[int, Lease] = dataclasses.field(default_factory=dict)
    orphan: bool = False
    writer_pid: int = 0  # of the session that held it, once it is an orphan
    # Highest lease id reserved in it: the writer numbers its leases upward and
    # announces them in order, so an unknown id at or below this is gone.
    last_lease: int = 0
    # Where a freed lease's run goes instead of back to the pool: a landed push
    # lives in a peer's standing push grant, which gets the run back.
    returns: Callable[[Run], None] | None = None
    # One byte per slot of the run, set while a lease record covers it: no two
    # live leases of a grant may share a slot, or freeing both frees it twice.
    busy: bytearray = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.busy = bytearray(self.run.nslots)

    def mark(self, run: Run, value: int) -> None:
        first = run.slot - self.run.slot
        self.busy[first : first + run.nslots] = bytes((value,)) * run.nslots

    def is_free(self, slot: int, nslots: int) -> bool:
        first = slot - self.run.slot
        return self.busy.find(1, first, first + nslots) < 0


@dataclasses.dataclass(eq=False)
class Lease:
    id: int
    generation: int
    grant: Grant
    run: Run
    state: LeaseState
    request_id: str
    from_stage: str
    to_stage: str
    writer: str
    created: float
    published_at: float = 0.0
    nbytes: int = 0
    claimer: str = ""
    # Found sealed in a dead writer's grant with no Reserve/Publish received
    # (see _adopt_sealed): its request and stages are unknown, so any reader
    # that names its lease id and generation may read and release it.
    adopted: bool = False


@dataclasses.dataclass(eq=False)
class RequestInfo:
    writers: set[str] = dataclasses.field(default_factory=set)
    readers: set[str] = dataclasses.field(default_factory=set)
    leases: set[int] = dataclasses.field(default_factory=set)
    aborted: bool = False
    touched: float = 0.0
    # Stages that aborted the request before any lease of it existed; the
    # tombstone only binds leases those stages write or read.
    aborters: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class Hooks:
    """Metric callbacks, so this module needs no Prometheus import."""

    reclaimed: Callable[[ReclaimReason, int], None] = lambda reason, n: None
    # (transport, count, bytes, from_stage, to_stage)
    transfer: Callable[[str, int, int, str, str], None] = lambda t, n, nbytes, src, dst: None
    reserve_wait: Callable[[float], None] = lambda seconds: None


@dataclasses.dataclass(eq=False)
class _Waiter:
    session: Session
    nslots: int
    future: asyncio.Future[Grant]
    since: float
    pool: str = "shm"


# Looked up once per publish: a dict, derived from the one spelling in Transport.
_TRANSPORT_NAMES = {t.to_proto(): t.value for t in Transport}


def transport_name(value: int) -> str:
    """The label a published transfer is counted under.

    A number this version does not know (a Publish that left it unset) is
    counted as shm, so that the labels stay the fixed set of transports.
    """
    return _TRANSPORT_NAMES.get(value, Transport.SHM.value)


class LeaseManager:
    def __init__(
        self,
        arena: Arena,
        *,
        grant_bytes: int,
        lease_ttl: float,
        stage_quota_bytes: int,
        max_sessions: int,
        max_session_grants: int = 64,
        max_grant_waits: int = 4,
        hooks: Hooks | None = None,
        clock: Callable[[], float] = time.monotonic,
        pools: Mapping[str, Pool] = {},
        freed_linger: float = 0.0,
        gpu_work_may_run: Callable[[int], bool] | None = None,
    ) -> None:
        self.arena = arena
        self.slot_size = arena.slot_size
        for name, extra in pools.items():
            if extra.slot_size != arena.slot_size or name == arena.name:
                raise ValueError(f"pool {name!r} must be new and share the arena's slot size")
        self.pools: dict[str, Pool] = {arena.name: arena, **pools}
        self.grant_slots = max(1, -(-grant_bytes // self.slot_size))
        self.lease_ttl = lease_ttl
        self.quota_slots = max(1, stage_quota_bytes // self.slot_size)
        self.max_sessions = max_sessions
        self.max_session_grants = max_session_grants
        self.max_grant_waits = max_grant_waits
        self.hooks = hooks or Hooks()
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        self.grants: dict[int, Grant] = {}
        self.leases: dict[int, Lease] = {}
        self.requests: dict[str, RequestInfo] = {}
        self.draining = False
        self._next_grant = 1
        self._next_session = 1
        self._waiters: collections.deque[_Waiter] = collections.deque()
        # Claims/releases that overtook their Publish (two sockets, no global
        # order): kind, session, generation, when, and the stages it served.
        self._early: dict[int, list[tuple[str, str, int, float, tuple[str, ...]]]] = {}
        self._early_count = 0  # entries in all of _early's lists
        self._freed_out: dict[str, list[int]] = {}  # by writer session
        self._freed_bytes: dict[str, int] = {}  # the arena they give back, by session
        # Freed notices wait this long to be batched (0: sent at the end of each turn).
        self.freed_linger = freed_linger
        self._freed_timer: asyncio.TimerHandle | None = None
        # GPU pool runs of a gone writer wait here while ``gpu_work_may_run``
        # (its pid) says its queued copies could still land in them.
        self.gpu_work_may_run = gpu_work_may_run
        self._fenced: list[tuple[Run, int, float]] = []
        # Leases a push is reading from: freeing one (abort, TTL, drain) keeps
        # its slots until the push has stopped reading them (see hold()).
        self._holds: set[int] = set()
        self._held: dict[int, Lease] = {}
        # Called with each lease published with Publish.push set (relayd.push).
        self.on_push: Callable[[Lease], None] | None = None

    # -- sessions -----------------------------------------------------------------

    def open_session(
        self,
        *,
        pid: int,
        stages: Iterable[str],
        namespaces: dict[str, str] | None = None,
        gpu_uuids: Iterable[str] = (),
    ) -> Session:
        # A draining daemon still admits sessions: a reader that attaches now
        # can collect in-flight data; only new reservations are refused.
        live = sum(1 for s in self.sessions.values() if s.state is not SessionState.CLOSED)
        if live >= self.max_sessions:
            raise ResourceExhaustedError(f"session limit reached ({self.max_sessions})")
        sid = f"s{self._next_session}-{secrets.token_hex(4)}"
        self._next_session += 1
        session = Session(
            id=sid,
            token=secrets.token_bytes(16),
            pid=pid,
            stages=tuple(stages),
            created=self.clock(),
            namespaces=dict(namespaces or {}),
            gpu_uuids=tuple(gpu_uuids),
        )
        self.sessions[sid] = session
        return session

    def authenticate(self, session_id: str, token: bytes) -> Session:
        session = self.sessions.get(session_id)
        if session is None or not secrets.compare_digest(session.token, token):
            raise PermissionDeniedError("unknown session or wrong session token")
        if session.state is SessionState.CLOSED:
            raise SessionClosedError("session is closed")
        return session

    def bind(
        self, session_id: str, token: bytes, sink: Sink, *, pid: int, uid: int, gid: int
    ) -> Session:
        session = self.authenticate(session_id, token)
        if session.state is not SessionState.PENDING:
            raise PermissionDeniedError("session is already bound to a connection")
        session.state = SessionState.BOUND
        session.sink = sink
        session.pid, session.uid, session.gid = pid, uid, gid
        return session

    def close_session(self, session_id: str) -> None:
        """The session's connection is gone: reclaim what only it could finish."""
        session = self.sessions.pop(session_id, None)
        if session is None or session.state is SessionState.CLOSED:
            return
        session.state = SessionState.CLOSED
        session.sink = None
        for lease_id in list(session.claimed):
            lease = self.leases.get(lease_id)
            if lease is not None and lease.state is LeaseState.CLAIMED:
                self._free_lease(lease, ReclaimReason.READER_DIED)
        for grant in list(session.grants.values()):
            self._orphan(grant, session)
        # after _orphan: adopting may free some
        self._freed_out.pop(session_id, None)
        self._freed_bytes.pop(session_id, None)
        session.grants.clear()
        session.granted_slots = 0
        session.pool_slots.clear()
        for w in self._waiters:
            if w.session is session and not w.future.done():
                w.future.set_exception(SessionClosedError("session closed while waiting"))
        self._wake()

    def _orphan(self, grant: Grant, writer: Session | None = None) -> None:
        if writer is not None:
            self._adopt_sealed(grant, writer)
        dropped = 0
        # A GPU pool lease is read by waiting on its writer's CUDA event, which
        # dies with the writer (using it after that is undefined), and a writer
        # killed with its copy queued may leave the event looking complete:
        # published GPU leases go with their writer, unread, never served.
        gpu = grant.run.pool != "shm"
        # A writer killed mid-copy (still exiting): a reader copying out of one
        # of its leases may have seen the event complete too early; clearing
        # the header makes that reader's check after its copy fail (its slots
        # are held until the writer has exited, see _orphan_run_back).
        killed = gpu and writer is not None and self._may_run(writer.pid)
        for lease in list(grant.leases.values()):
            state = lease.state
            if (
                state is LeaseState.RESERVED
                or (gpu and state is LeaseState.PUBLISHED)
                or (killed and state is LeaseState.CLAIMED)
            ):
                self._forget(lease)
                dropped += 1
        if dropped:
            self.hooks.reclaimed(ReclaimReason.WRITER_DIED, dropped)
        grant.orphan = True
        if writer is not None:
            grant.writer_pid = writer.pid
        # Give back every part of the run no published lease sits on.
        # (and no freed lease a push is still reading: see hold()).
        live = [*grant.leases.values(), *(h for h in self._held.values() if h.grant is grant)]
        kept = sorted((lease.run.slot, lease.run.nslots) for lease in live)
        cursor = grant.run.slot
        end = grant.run.slot + grant.run.nslots
        for slot, n in [*kept, (end, 0)]:
            if slot > cursor:
                self._orphan_run_back(
                    Run(grant.run.segment, cursor, slot - cursor, grant.run.pool), grant
                )
            cursor = max(cursor, slot + n)
        if not grant.leases:
            self.grants.pop(grant.id, None)

    def _adopt_sealed(self, grant: Grant, writer: Session) -> None:
        """Publish what a dead writer sealed but never announced.

        A writer's Publish notices linger (up to the client's NOTICE_LINGER_S),
        so it can die after handing out a DataRef the daemon has not heard of. Its slot
        headers say what it sealed: a RESERVED lease whose header carries its
        generation is published, and a header of this grant's generation over
        slots no known lease covers is a lease whose Reserve never came.
        """
        if grant.run.pool != "shm":
            return
        adopted = 0
        start, end = grant.run.slot, grant.run.slot + grant.run.nslots
        busy = bytearray(grant.run.nslots)
        for lease in list(grant.leases.values()):
            first = lease.run.slot - start
            busy[first : first + lease.run.nslots] = b"\x01" * lease.run.nslots
            if lease.state is LeaseState.RESERVED:
                length = self._sealed_length(lease)
                if length is not None:
                    self._published(lease, length, "shm")
                    adopted += 1
        slot = start
        while slot < end:
            gen, length = self.arena.header(grant.run.segment, slot)
            nslots = max(1, -(-length // self.slot_size))
            if (
                busy[slot - start]
                or gen >> GEN_SHIFT != grant.id
                or not gen & ((1 << GEN_SHIFT) - 1)
                or gen in self.leases
                or slot + nslots > end
                or any(busy[slot - start : slot - start + nslots])
            ):
                slot += 1
                continue
            lease = Lease(
                id=gen,
                generation=gen,
                grant=grant,
                run=Run(grant.run.segment, slot, nslots, grant.run.pool),
                state=LeaseState.RESERVED,
                request_id="",
                from_stage=writer.stages[0] if writer.stages else "",
                to_stage="",
                writer=writer.id,
                created=self.clock(),
                adopted=True,
            )
            grant.leases[lease.id] = lease
            grant.mark(lease.run, 1)
            self.leases[lease.id] = lease
            self._published(lease, length, "shm")
            adopted += 1
            slot += nslots
        if adopted:
            log.info(
                "published %d sealed leases of a writer that died before announcing them",
                adopted,
                extra={"session_id": writer.id},
            )

    # -- grants ---------------------------------------------------------------------

    async def grant(
        self, session: Session, min_bytes: int, timeout: float, pool: str = "shm"
    ) -> Grant:
        if self.draining:
            raise DrainingError("daemon is draining; no new reservations")
        if min_bytes < 0:
            raise InvalidArgumentError("min_bytes must be >= 0")
        if self._freed_out.get(session.id):
            # A writer asks for space only when its grants are full: what
            # readers freed in them (batched, see flush) may be enough.
            self._send_freed([session.id])
        # What one session may hold or wait for.
        if len(session.grants) >= self.max_session_grants:
            raise ResourceExhaustedError(
                f"session holds {len(session.grants)} grants (limit --max-session-grants "
                f"{self.max_session_grants}); return idle ones first"
            )
        if sum(1 for w in self._waiters if w.session is session) >= self.max_grant_waits:
            raise ResourceExhaustedError(
                f"session already has {self.max_grant_waits} grant calls waiting for space "
                "(limit --max-grant-waits)"
            )
        arena = self.pools.get(pool)
        if arena is None:
            raise InvalidArgumentError(f"this daemon has no pool {pool[:80]!r}")
        need = max(1, -(-min_bytes // self.slot_size))
        if need > arena.max_run_slots():
            raise ResourceExhaustedError(
                f"{min_bytes} bytes exceed the largest possible run in {pool} "
                f"({arena.max_run_slots() * self.slot_size} bytes); raise "
                f"{_size_flag(pool, self.arena.name)} (and --shm-segment-size for the arena)"
            )
        if need > self._quota(pool):
            raise ResourceExhaustedError(
                f"{min_bytes} bytes exceed the per-stage quota of "
                f"{self._quota(pool) * self.slot_size} bytes in {pool}; raise "
                f"{_quota_flag(pool, self.arena.name)}"
            )
        nslots = max(need, self.grant_slots) if need <= self.grant_slots else need
        # Shrink the default grant when the pool is tight rather than wait for
        # it, and to what the stage's quota leaves: a default grant larger than
        # the quota (--grant-size above --max-stage-bytes) would wait forever.
        if nslots > need and arena.largest_free_run() < nslots:
            nslots = need
        if nslots > need:
            nslots = max(need, min(nslots, self._stage_room(session, pool)))
        return await self._grant_slots(session, nslots, timeout, pool)

    async def _grant_slots(
        self, session: Session, nslots: int, timeout: float, pool: str = "shm"
    ) -> Grant:
        arena = self.pools[pool]
        start = self.clock()
        granted = self._try_grant(session, nslots, pool)
        if granted is not None and not any(w.pool == pool for w in self._waiters):
            self.hooks.reserve_wait(0.0)
            return granted
        if granted is not None:  # someone waits already: fairness first
            self._ungrant(granted)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(session, nslots, loop.create_future(), start, pool)
        self._waiters.append(waiter)
        self._wake()
        if not waiter.future.done():
            # Space is short, so nothing that would free some may linger: the
            # Freed notices go now, and every other session is asked to return
            # its idle grants and to send the releases it holds back.
            self._send_freed()
            reclaim = pb.SessionFrame(event=[pb.Event(kind=pb.EVENT_KIND_RECLAIM)])
            for s in self.sessions.values():
                if s.sink is not None and s is not session:
                    s.sink(reclaim)
        try:
            grant = await asyncio.wait_for(asyncio.shield(waiter.future), timeout=max(timeout, 0.0))
        except TimeoutError:
            if (
                waiter.future.done()
                and not waiter.future.cancelled()
                and not waiter.future.exception()
            ):
                grant = waiter.future.result()  # granted in the same tick as the timeout
            else:
                waiter.future.cancel()
                self._drop_waiter(waiter)
                raise ResourceExhaustedError(
                    f"no {nslots * self.slot_size} byte run became free within {timeout:.3g}s "
                    f"({pool} {arena.used_bytes}/{arena.capacity_bytes} bytes in use)"
                ) from None
        except asyncio.CancelledError:
            if (
                waiter.future.done()
                and not waiter.future.cancelled()
                and not waiter.future.exception()
            ):
                self._ungrant(waiter.future.result())
            waiter.future.cancel()
            self._drop_waiter(waiter)
            raise
        self.hooks.reserve_wait(self.clock() - start)
        return grant

    def _drop_waiter(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass
        self._wake()

    def _quota(self, pool: str) -> int:
        # The stage quota is sized for the arena; a GPU pool holds at most half its own size.
        if pool == self.arena.name:
            return self.quota_slots
        return max(1, self.pools[pool].capacity_bytes // self.slot_size // 2)

    def _stage_room(self, session: Session, pool: str) -> int:
        """Slots the session may still be granted before one of its stages hits its quota.

        The quota is per stage, summed over every session serving it, so a stage
        cannot take the node by opening more sessions. O(sessions), on grants only.
        """
        quota = self._quota(pool)
        held = max(
            (
                sum(s.pool_slots.get(pool, 0) for s in self.sessions.values() if stage in s.stages)
                for stage in session.stages
            ),
            default=0,
        )
        return quota - held

    def _over_stage_quota(self, session: Session, nslots: int, pool: str) -> bool:
        return nslots > self._stage_room(session, pool)

    def _try_grant(self, session: Session, nslots: int, pool: str = "shm") -> Grant | None:
        if session.state is SessionState.CLOSED:
            raise SessionClosedError("session closed")
        if self._over_stage_quota(session, nslots, pool):
            return None
        run = self.pools[pool].allocate(nslots)
        if run is None:
            return None
        grant = Grant(self._next_grant, session.id, run)
        self._next_grant += 1
        self.grants[grant.id] = grant
        session.grants[grant.id] = grant
        session.granted_slots += nslots
        session.pool_slots[pool] = session.pool_slots.get(pool, 0) + nslots
        return grant

    def _ungrant(self, grant: Grant) -> None:
        session = self.sessions.get(grant.session_id)
        if session is not None:
            session.grants.pop(grant.id, None)
            session.granted_slots -= grant.run.nslots
            session.pool_slots[grant.run.pool] -= grant.run.nslots
        self.grants.pop(grant.id, None)
        self._pool_free(grant.run)

    def _wake(self) -> None:
        """Serve waiters in arrival order; one blocked on its own quota doesn't block others."""
        while self._waiters and self._waiters[0].future.done():
            self._waiters.popleft()
        full: set[str] = set()
        for waiter in list(self._waiters):
            if waiter.future.done() or waiter.pool in full:
                continue
            s = waiter.session
            if self._over_stage_quota(s, waiter.nslots, waiter.pool):
                continue
            grant = self._try_grant(s, waiter.nslots, waiter.pool)
            if grant is None:
                # The pool is full for its oldest waiter: nobody overtakes it
                # there, but waiters on other pools are still served.
                full.add(waiter.pool)
                continue
            waiter.future.set_result(grant)
            self._waiters.remove(waiter)

    # -- cross-node pulls (the reader's side) ------------------------------------------
    #
    # A pull lands in a run the daemon itself owns: an orphan grant holding exactly
    # one lease, so the normal rules free it (the reader's Release, TTL, abort,
    # drain) and the slots go straight back to the arena. The lease stays RESERVED
    # (invisible to readers, untouched by TTL and abort) while bytes may still land.

    async def reserve_for_pull(
        self,
        session: Session,
        nbytes: int,
        timeout: float,
        *,
        request_id: str,
        from_stage: str,
        to_stage: str,
    ) -> Lease:
        """A RESERVED lease of ``nbytes`` for ``session`` to read once the pull is in."""
        if self.draining:
            raise DrainingError("daemon is draining; no new reservations")
        need = max(1, -(-nbytes // self.slot_size))
        if need > self.arena.max_run_slots() or need > self.quota_slots:
            raise ResourceExhaustedError(
                f"{nbytes} bytes exceed the largest run this daemon can hold for one reader; "
                "raise --shm-pool-size (and --max-stage-bytes)"
            )
        # Waits fairly with the writers, counted against the reader's quota while
        # it waits; once granted the daemon owns the run, not the session.
        grant = await self._grant_slots(session, need, timeout)
        session.grants.pop(grant.id, None)
        session.granted_slots -= grant.run.nslots
        session.pool_slots[grant.run.pool] -= grant.run.nslots
        grant.session_id = ""
        grant.orphan = True
        lease_id = (grant.id << GEN_SHIFT) | 1
        lease = Lease(
            id=lease_id,
            generation=lease_id,
            grant=grant,
            run=grant.run,
            state=LeaseState.RESERVED,
            request_id=request_id[:256],
            from_stage=from_stage[:256],
            to_stage=to_stage[:256],
            writer="",
            created=self.clock(),
        )
        grant.leases[lease.id] = lease
        grant.mark(lease.run, 1)
        self.leases[lease.id] = lease
        req = self._touch(lease.request_id, lease.created)
        req.writers.add(lease.from_stage)
        req.readers.add(lease.to_stage)
        req.leases.add(lease.id)
        return lease

    def publish_pull(self, lease: Lease, nbytes: int) -> None:
        """The pulled bytes are in and verified: stamp the header, let the reader read."""
        if self.leases.get(lease.id) is not lease:
            raise DrainingError("the pulled lease was reclaimed (drain) before it was published")
        req = self.requests.get(lease.request_id)
        if req is not None and req.aborted:
            self._free_lease(lease, ReclaimReason.ABORT)
            self._wake()
            raise AbortedError(f"request {lease.request_id!r} was aborted")
        self.arena.segments[lease.run.segment].write_header(
            lease.run.slot, lease.generation, nbytes
        )
        lease.state = LeaseState.PUBLISHED
        lease.published_at = self.clock()
        lease.nbytes = nbytes
        self.hooks.transfer("mooncake", 1, nbytes, lease.from_stage, lease.to_stage)

    def drop_pull(self, lease: Lease) -> None:
        """Give back a pull's run (failed, or settled after a failure). Idempotent."""
        if self.leases.get(lease.id) is lease:
            self._forget(lease)

    # -- cross-node pushes ----------------------------------------------------------

    def hold(self, lease: Lease) -> None:
        """A push reads ``lease``'s slots: whatever frees the lease meanwhile (abort,
        TTL, drain, a reader) frees the record at once but the slots only at
        :meth:`unhold`, so the writer cannot refill them under the push."""
        self._holds.add(lease.id)

    def unhold(self, lease: Lease) -> None:
        self._holds.discard(lease.id)
        held = self._held.pop(lease.id, None)
        if held is not None:
            self._return_slots(held)
            self.flush()

    def free_pushed(self, lease: Lease) -> bool:
        """The push of ``lease`` landed at the consumer's node: free it here, as its
        reader would. False when it had been freed meanwhile (abort, TTL)."""
        live = self.leases.get(lease.id) is lease and lease.state is LeaseState.PUBLISHED
        if live:
            self._free_lease(lease, None)
        self.unhold(lease)
        return live

    def adopt_push(
        self,
        run: Run,
        nbytes: int,
        *,
        request_id: str,
        from_stage: str,
        to_stage: str,
        returns: Callable[[Run], None],
    ) -> Lease:
        """A PUBLISHED lease over ``run``, a part of a push grant whose bytes a peer
        has written: read, expired and aborted like any lease; its run then goes
        to ``returns``, not to the pool."""
        if self.draining:
            raise DrainingError("daemon is draining; no new leases")
        gid = self._next_grant
        self._next_grant += 1
        grant = Grant(gid, "", run, orphan=True, returns=returns)
        lease_id = (gid << GEN_SHIFT) | 1
        now = self.clock()
        lease = Lease(
            id=lease_id,
            generation=lease_id,
            grant=grant,
            run=run,
            state=LeaseState.PUBLISHED,
            request_id=request_id[:256],
            from_stage=from_stage[:256],
            to_stage=to_stage[:256],
            writer="",
            created=now,
            published_at=now,
            nbytes=nbytes,
        )
        self.grants[gid] = grant
        grant.leases[lease.id] = lease
        grant.mark(lease.run, 1)
        self.leases[lease.id] = lease
        req = self._touch(lease.request_id, now)
        req.writers.add(lease.from_stage)
        req.readers.add(lease.to_stage)
        req.leases.add(lease.id)
        self.arena.segments[run.segment].write_header(run.slot, lease.generation, nbytes)
        self.hooks.transfer("mooncake", 1, nbytes, lease.from_stage, lease.to_stage)
        return lease

    # -- cross-node pulls (the writer's side) -------------------------------------------

    def release_from_peer(
        self, lease_id: int, generation: int, reader_stages: Collection[str] | None = None
    ) -> bool:
        """A peer pulled this lease: free it as its reader would. False: it was gone
        (read, expired, aborted) or never published, so the peer's copy is void.

        ``reader_stages``: the stages of the session the peer pulled for. As for
        a local reader, the lease must be addressed to one of them - its
        recorded to_stage, whatever the DataRef the peer was handed says - or
        nothing is freed (PermissionDeniedError). None: a discard by a holder
        of the DataRef, which may free it unread wherever it is.
        """
        stages = tuple(reader_stages) if reader_stages is not None else None
        lease = self.leases.get(lease_id)
        if lease is None or lease.state is LeaseState.RESERVED:
            # The writer's notices linger: the peer may have read a lease whose
            # Reserve and Publish are still on the way (its copy checked the
            # sealed header). The release waits for them, like a local one.
            if lease is None:
                grant = self.grants.get(lease_id >> GEN_SHIFT)
                if grant is None or lease_id <= grant.last_lease:
                    return False  # no such grant, or announced and already freed
            if lease_id != generation:
                return False
            if lease is not None and self._sealed_length(lease) is None:
                return False
            if stages is None:
                return self._park(lease_id, ("discard", "", generation, self.clock(), ()))
            return self._park(lease_id, ("peer", "", generation, self.clock(), stages))
        if lease.generation != generation:
            return False
        if lease.state is not LeaseState.PUBLISHED:
            return False
        if stages is not None and not (lease.adopted or lease.to_stage in stages):
            raise PermissionDeniedError(
                f"lease {lease_id} is addressed to stage {lease.to_stage[:64]!r}, not to the "
                "pulling reader's"
            )
        self._free_lease(lease, None)
        self.flush()
        return True

    def abort_from_peer(self, request_id: str) -> int:
        """A peer aborted ``request_id``: free it here too (the peer was authenticated)."""
        return self._abort(request_id)[0]

    def return_grant(self, session: Session, grant_id: int) -> None:
        grant = session.grants.get(grant_id)
        if grant is None:
            return
        if grant.leases:
            self._event(
                session,
                pb.ERROR_CODE_INVALID_ARGUMENT,
                f"grant {grant_id} returned with {len(grant.leases)} leases in it",
            )
            return
        self._ungrant(grant)
        self._wake()

    def detach_grant(self, session: Session, grant: Grant) -> None:
        """Hand a grant's published leases to the daemon (the socket fallback's PutBytes).

        The grant becomes an orphan at once: the rest of its run goes back to
        the pool now, and each lease frees its own run when read, aborted or
        expired, exactly as for a writer that died after publishing.
        """
        if session.grants.pop(grant.id, None) is not None:
            session.granted_slots -= grant.run.nslots
            session.pool_slots[grant.run.pool] -= grant.run.nslots
        self._orphan(grant)
        self._wake()

    # -- notices (hot path) ---------------------------------------------------------

    def on_reserve(self, session: Session, r: pb.Reserve, cancelled: Collection[int] = ()) -> None:
        """Record a lease the writer cut from one of its grants.

        Raises (the caller closes the session) unless the lease lies inside a
        grant this session holds, overlaps no live lease of it, and carries an
        id of that grant (``grant id << GEN_SHIFT | n``, ``n`` above every id
        reserved in it before): ids are then owned by their grant, so no
        session can take another's, and none is ever recorded twice.

        ``cancelled``: the lease ids the same frame cancels. A writer reuses a
        cancelled lease's slots at once, and a frame's reserves are handled
        before its cancels, so a Reserve over a lease this session cancels in
        the same frame takes that cancel first.
        """
        grant = session.grants.get(r.grant_id)
        if grant is None:
            raise InvalidArgumentError(
                f"lease {r.lease_id} names grant {r.grant_id}, which this session does not hold"
            )
        if not (
            r.nslots >= 1
            and grant.run.slot <= r.slot
            and r.slot + r.nslots <= grant.run.slot + grant.run.nslots
        ):
            raise InvalidArgumentError(
                f"lease {r.lease_id} (slots {r.slot}+{r.nslots}) lies outside grant {grant.id}"
            )
        if (
            r.lease_id != r.generation
            or r.lease_id >> GEN_SHIFT != grant.id
            or not r.lease_id & ((1 << GEN_SHIFT) - 1)
        ):
            raise InvalidArgumentError(
                f"lease id {r.lease_id} (generation {r.generation}) is not an id of grant "
                f"{grant.id}"
            )
        if r.lease_id <= grant.last_lease or r.lease_id in self.leases:
            raise InvalidArgumentError(
                f"lease id {r.lease_id} was used already in grant {grant.id}; ids go upward"
            )
        if not grant.is_free(r.slot, r.nslots) and not self._cancel_first(
            session, grant, r, cancelled
        ):
            raise InvalidArgumentError(
                f"lease {r.lease_id} (slots {r.slot}+{r.nslots}) would overlap a live lease "
                f"of grant {grant.id}"
            )
        if r.from_stage[:256] not in session.stages:
            # A writer names itself; claiming another stage's name would let it
            # pass that stage's abort check.
            raise PermissionDeniedError(
                f"lease {r.lease_id} names from_stage {r.from_stage[:64]!r}, not this session's"
            )
        lease = Lease(
            id=r.lease_id,
            generation=r.generation,
            grant=grant,
            run=Run(grant.run.segment, r.slot, r.nslots, grant.run.pool),
            state=LeaseState.RESERVED,
            request_id=r.request_id[:256],
            from_stage=r.from_stage[:256],
            to_stage=r.to_stage[:256],
            writer=session.id,
            created=self.clock(),
        )
        grant.mark(lease.run, 1)
        grant.leases[lease.id] = lease
        grant.last_lease = max(grant.last_lease, lease.id)
        self.leases[lease.id] = lease
        req = self._touch(lease.request_id, lease.created)
        if req.aborted and req.aborters and not req.aborters & {lease.from_stage, lease.to_stage}:
            # A stage with no part in this lease cannot abort it ahead of time.
            req.aborted = False
            req.aborters.clear()
        req.writers.add(lease.from_stage)
        req.readers.add(lease.to_stage)
        req.leases.add(lease.id)

    def _cancel_first(
        self, session: Session, grant: Grant, r: pb.Reserve, cancelled: Collection[int]
    ) -> bool:
        """Forget the leases ``r`` overlaps if the same frame cancels every one of them."""
        if not cancelled:
            return False
        end = r.slot + r.nslots
        clash = [
            lease for lease in grant.leases.values()
            if lease.run.slot < end and r.slot < lease.run.slot + lease.run.nslots
        ]  # fmt: skip
        if not all(
            lease.id in cancelled
            and lease.writer == session.id
            and lease.state is LeaseState.RESERVED
            for lease in clash
        ):
            return False
        for lease in clash:
            self._forget(lease)
        return True

    def on_publish(self, session: Session, p: pb.Publish) -> None:
        lease = self.leases.get(p.lease_id)
        if lease is None or lease.writer != session.id or lease.state is not LeaseState.RESERVED:
            self._event(
                session, pb.ERROR_CODE_INVALID_ARGUMENT, f"bad publish of lease {p.lease_id}"
            )
            return
        self._published(lease, p.nbytes, transport_name(p.transport))
        if p.push and self.on_push is not None and self.leases.get(lease.id) is lease:
            self.on_push(lease)

    def _published(self, lease: Lease, nbytes: int, transport: str) -> None:
        """``lease`` is sealed: readable, on the TTL clock, and owed what came early."""
        lease.state = LeaseState.PUBLISHED
        lease.published_at = self.clock()
        lease.nbytes = min(nbytes, lease.run.nslots * self.slot_size)
        self.hooks.transfer(transport, 1, lease.nbytes, lease.from_stage, lease.to_stage)
        req = self.requests.get(lease.request_id)
        if req is not None and req.aborted:
            self._free_lease(lease, ReclaimReason.ABORT)
            return
        early = self._early.pop(lease.id, [])
        self._early_count -= len(early)
        for kind, sid, gen, _t, stages in early:
            if self.leases.get(lease.id) is not lease:
                return  # an earlier notice freed it
            if kind in ("peer", "discard"):
                # A pull's release holds only for the stage the lease is addressed to.
                if gen == lease.generation and (
                    kind == "discard" or lease.adopted or lease.to_stage in stages
                ):
                    self._free_lease(lease, None)
                continue
            reader = self.sessions.get(sid)
            if reader is None:
                # The reader read and went before the Publish landed (the
                # writer's notices linger): what it said still holds. A claim
                # it can no longer release ends as its death would have.
                if gen == lease.generation and (lease.to_stage in stages or lease.adopted):
                    self._free_lease(
                        lease, None if kind == "release" else ReclaimReason.READER_DIED
                    )
                continue
            # What the reader said is judged now, against the reader alone:
            # nothing it sent may fail the writer's frame being handled.
            try:
                if kind == "claim":
                    self.on_claim(reader, pb.Claim(lease_id=lease.id, generation=gen))
                else:
                    self.on_release(reader, pb.Release(lease_id=lease.id, generation=gen))
            except RelayError as err:
                self._event(reader, pb.ERROR_CODE_INVALID_ARGUMENT, str(err))

    def _sealed_length(self, lease: Lease) -> int | None:
        """The length the writer sealed ``lease`` with, per its slot header; None if unsealed.

        The header is written only once the bytes are in, so it is the truth
        about a lease whose Publish notice has not arrived (it lingers; see
        the client's SessionChannel.mark) or never will (the writer died).
        """
        if lease.run.pool != "shm":
            return None
        gen, length = self.arena.header(lease.run.segment, lease.run.slot)
        if gen != lease.generation or length > lease.run.nslots * self.slot_size:
            return None
        return length

    def on_cancel(self, session: Session, c: pb.Cancel) -> None:
        lease = self.leases.get(c.lease_id)
        if lease is not None and lease.writer == session.id and lease.state is LeaseState.RESERVED:
            self._forget(lease)

    def _reader_lease(
        self, session: Session, lease_id: int, generation: int, kind: str
    ) -> Lease | None:
        lease = self.leases.get(lease_id)
        if lease is None or lease.state is LeaseState.RESERVED:
            if lease is None and (
                generation != lease_id or lease_id >> GEN_SHIFT not in self.grants
            ):
                return None  # not an id of a live grant: nothing will come to settle it
            held = self._early.get(lease_id, ())
            if sum(1 for entry in held if entry[1] == session.id) >= MAX_EARLY_PER_SESSION:
                raise InvalidArgumentError(
                    f"more than {MAX_EARLY_PER_SESSION} claims/releases of lease {lease_id} "
                    "before it was published"
                )
            self._park(lease_id, (kind, session.id, generation, self.clock(), session.stages))
            return None
        if lease.generation != generation:
            return None  # stale: the reader already saw that in the slot header
        if (
            lease.to_stage not in session.stages
            and lease.claimer != session.id
            and not lease.adopted
        ):
            self._event(
                session,
                pb.ERROR_CODE_PERMISSION_DENIED,
                f"lease {lease_id} is addressed to stage {lease.to_stage!r}",
            )
            return None
        return lease

    def on_claim(self, session: Session, c: pb.Claim) -> None:
        lease = self._reader_lease(session, c.lease_id, c.generation, "claim")
        if lease is None or lease.state is not LeaseState.PUBLISHED:
            return
        lease.state = LeaseState.CLAIMED
        lease.claimer = session.id
        session.claimed.add(lease.id)

    def on_release(self, session: Session, r: pb.Release) -> None:
        lease = self._reader_lease(session, r.lease_id, r.generation, "release")
        if lease is None:
            return
        if lease.state is LeaseState.CLAIMED and lease.claimer != session.id:
            self._event(
                session,
                pb.ERROR_CODE_PERMISSION_DENIED,
                f"lease {r.lease_id} is claimed by another session",
            )
            return
        self._free_lease(lease, None)

    # -- freeing --------------------------------------------------------------------

    def _forget(self, lease: Lease) -> None:
        """Drop a lease record; the slots go back to whoever owns the grant."""
        self.leases.pop(lease.id, None)
        lease.grant.leases.pop(lease.id, None)
        req = self.requests.get(lease.request_id)
        if req is not None:
            req.leases.discard(lease.id)
        if lease.claimer:
            claimer = self.sessions.get(lease.claimer)
            if claimer is not None:
                claimer.claimed.discard(lease.id)
        if lease.id in self._holds:
            self._held[lease.id] = lease  # the slots wait for unhold()
            return
        self._return_slots(lease)

    def _return_slots(self, lease: Lease) -> None:
        pool = self.pools[lease.run.pool]
        pool.clear_header(lease.run.segment, lease.run.slot)
        grant = lease.grant
        grant.mark(lease.run, 0)
        if grant.returns is not None:
            self.grants.pop(grant.id, None)
            grant.returns(lease.run)
        elif grant.orphan:
            self._orphan_run_back(lease.run, grant)
            if not grant.leases:
                self.grants.pop(grant.id, None)
            self._wake()
        else:
            sid = grant.session_id
            self._freed_out.setdefault(sid, []).append(lease.id)
            self._freed_bytes[sid] = (
                self._freed_bytes.get(sid, 0) + lease.run.nslots * self.slot_size
            )

    def _orphan_run_back(self, run: Run, grant: Grant) -> None:
        """A run of an orphaned grant goes back to its pool.

        Not a GPU run while its writer may still run GPU work: a writer killed
        with a copy queued into it is still exiting when its session's socket
        closes (its CUDA context goes with its last file descriptors), and the
        copy could land on the next lease in those slots. Such runs are
        released by :meth:`reap` once the writer has exited.
        """
        if run.pool != "shm" and self._may_run(grant.writer_pid):
            self._fenced.append((run, grant.writer_pid, self.clock()))
            return
        self._pool_free(run)

    def _may_run(self, pid: int) -> bool:
        return self.gpu_work_may_run is not None and self.gpu_work_may_run(pid)

    def _release_fenced(self, now: float) -> None:
        keep: list[tuple[Run, int, float]] = []
        released = False
        for run, pid, since in self._fenced:
            if self._may_run(pid) and now - since < GPU_FENCE_LIMIT_S:
                keep.append((run, pid, since))
                continue
            if now - since >= GPU_FENCE_LIMIT_S:
                log.error(
                    "GPU writer %d still exiting after %.0f s; its slots go back", pid, now - since
                )
            self._pool_free(run)
            released = True
        self._fenced = keep
        if released:
            self._wake()

    def _park(self, lease_id: int, entry: tuple[str, str, int, float, tuple[str, ...]]) -> bool:
        """Hold a claim/release until ``lease_id`` is published; False when full."""
        held = self._early.setdefault(lease_id, [])
        if len(held) >= MAX_EARLY_PER_LEASE or self._early_count >= MAX_EARLY:
            if not held:
                del self._early[lease_id]
            return False
        held.append(entry)
        self._early_count += 1
        return True

    def _pool_free(self, run: Run) -> None:
        """Give ``run`` back to its pool. A double free is a bug in this module:
        the allocator refuses it before changing anything, and it is logged,
        never raised into whichever handler or sweep was freeing."""
        try:
            self.pools[run.pool].free(run)
        except ValueError as exc:
            log.error("refused to free %s: %s", run, exc)

    def _free_lease(self, lease: Lease, reason: ReclaimReason | None) -> None:
        self._forget(lease)
        if reason is not None:
            self.hooks.reclaimed(reason, 1)
            log.info(
                "reclaimed lease",
                extra={
                    "lease_id": lease.id,
                    "request_id": lease.request_id,
                    "reason": reason.value,
                    "session_id": lease.writer,
                },
            )

    def flush(self) -> None:
        """Send the Freed notices pending, one frame per writer session - now, or
        batched over ``freed_linger``.

        A writer needs Freed only to reuse the slots of grants it holds, and
        it holds several idle grants' worth; a writer that runs short asks
        for a grant, which sends its notices at once (:meth:`grant`). So
        they can wait: batching turns one wakeup of the writer (and a send
        here) per transfer into one per linger. Not once a writer's pending
        notices give back ``FREED_LINGER_MAX_BYTES``, though: a writer that
        cannot reuse the slots it just wrote takes cold ones, and copying into
        cache-cold memory made 4 MiB transfers ~12% slower (measured). And not
        while a Grant waits for space (see :meth:`_grant_slots`).
        """
        if self.freed_linger <= 0 or any(not w.future.done() for w in self._waiters):
            self._send_freed()
            return
        due = [sid for sid, n in self._freed_bytes.items() if n >= FREED_LINGER_MAX_BYTES]
        if due:
            self._send_freed(due)
        if self._freed_out and self._freed_timer is None:
            loop = asyncio.get_running_loop()
            self._freed_timer = loop.call_later(self.freed_linger, self._send_freed)

    def _send_freed(self, sids: Iterable[str] | None = None) -> None:
        """Freed frames to ``sids`` (default: every session with notices pending)."""
        if sids is None:
            if self._freed_timer is not None:
                self._freed_timer.cancel()
                self._freed_timer = None
            sids = list(self._freed_out)
        for sid in sids:
            ids = self._freed_out.pop(sid, None)
            self._freed_bytes.pop(sid, None)
            session = self.sessions.get(sid)
            if ids and session is not None and session.sink is not None:
                session.sink(pb.SessionFrame(freed=pb.Freed(lease_ids=ids)))

    def _event(self, session: Session, code: pb.ErrorCode, message: str) -> None:
        log.warning("session %s: %s", session.id, message, extra={"session_id": session.id})
        if session.sink is not None:
            session.sink(
                pb.SessionFrame(
                    event=[pb.Event(kind=pb.EVENT_KIND_ERROR, code=code, message=message)]
                )
            )

    # -- abort, TTL, drain ----------------------------------------------------------

    def abort(self, session: Session, request_id: str) -> tuple[int, int]:
        req = self.requests.get(request_id)
        if req is None:
            self._cap_tombstones()
            req = self.requests[request_id] = RequestInfo(touched=self.clock())
            req.aborters.update(session.stages)
        elif not (set(session.stages) & (req.writers | req.readers)):
            raise PermissionDeniedError(
                f"stage(s) {', '.join(session.stages)} neither wrote nor read request {request_id!r}"
            )
        return self._abort(request_id)

    def _abort(self, request_id: str) -> tuple[int, int]:
        req = self._touch(request_id, self.clock())
        req.aborted = True
        n = nbytes = 0
        for lease_id in list(req.leases):
            lease = self.leases.get(lease_id)
            if lease is not None and lease.state is not LeaseState.RESERVED:
                n += 1
                nbytes += lease.nbytes
                self._free_lease(lease, ReclaimReason.ABORT)
        frame = pb.SessionFrame(aborted=[pb.Aborted(request_id=request_id)])
        # Only the request's own stages hear of it: a client remembers aborted
        # ids and refuses puts to them, which must not reach uninvolved stages.
        involved = req.writers | req.readers | req.aborters
        for s in self.sessions.values():
            if s.sink is not None and (not involved or involved & set(s.stages)):
                s.sink(frame)
        self.flush()
        return n, nbytes

    def _touch(self, request_id: str, now: float) -> RequestInfo:
        """The record of ``request_id``, moved to the young end: the dict stays in
        touch order, so :meth:`reap` stops at the first record it keeps."""
        req = self.requests.pop(request_id, None) or RequestInfo()
        req.touched = now
        self.requests[request_id] = req
        return req

    def _cap_tombstones(self) -> None:
        if len(self.requests) < MAX_TOMBSTONES:
            return
        # dicts keep insertion order: the oldest records go first.
        for rid in [r for r, v in self.requests.items() if not v.leases][: MAX_TOMBSTONES // 4]:
            del self.requests[rid]

    def reap(self) -> int:
        """Expire unread leases, unbound sessions and old request records."""
        now = self.clock()
        expired = [
            lease for lease in self.leases.values()
            if lease.state is LeaseState.PUBLISHED and now - lease.published_at > self.lease_ttl
        ]  # fmt: skip
        for lease in expired:
            try:
                self._free_lease(lease, ReclaimReason.TTL)
            except Exception:  # one bad record must not stop the sweep
                log.exception("could not expire lease %d", lease.id)
        if self._fenced:
            self._release_fenced(now)
        for s in [s for s in self.sessions.values() if s.state is SessionState.PENDING]:
            if now - s.created > BIND_DEADLINE:
                self.close_session(s.id)
        for lid in [k for k, v in self._early.items() if now - v[0][3] > BIND_DEADLINE]:
            self._early_count -= len(self._early.pop(lid))
        excess = len(self.requests) - MAX_REQUEST_RECORDS
        old: list[str] = []
        for rid, req in self.requests.items():  # oldest first
            if excess <= 0 and now - req.touched <= REQUEST_MEMORY:
                break
            if not req.leases:
                old.append(rid)
                excess -= 1
        for rid in old:
            del self.requests[rid]
        self.flush()
        return len(expired)

    def start_drain(self) -> None:
        self.draining = True
        for w in self._waiters:
            if not w.future.done():
                w.future.set_exception(DrainingError("daemon is draining"))
        self._waiters.clear()
        frame = pb.SessionFrame(
            event=[
                pb.Event(
                    kind=pb.EVENT_KIND_DRAINING,
                    code=pb.ERROR_CODE_DRAINING,
                    message="daemon is draining",
                )
            ]
        )
        for s in self.sessions.values():
            if s.sink is not None:
                s.sink(frame)

    def drop_all(self) -> None:
        """End of drain: whatever is left is reclaimed (and counted)."""
        for lease in list(self.leases.values()):
            self._free_lease(lease, ReclaimReason.DRAIN)

    # -- views for status and metrics -----------------------------------------------

    @property
    def in_flight(self) -> int:
        return sum(1 for lease in self.leases.values() if lease.state is not LeaseState.RESERVED)

    def lease_slots(self, pool: str = "shm") -> int:
        return sum(lease.run.nslots for lease in self.leases.values() if lease.run.pool == pool)

    def granted_slots(self, pool: str = "shm") -> int:
        return sum(
            g.run.nslots for g in self.grants.values() if not g.orphan and g.run.pool == pool
        )

    def leases_by_state(self, pool: str = "shm") -> dict[LeaseState, int]:
        counts = dict.fromkeys(LeaseState, 0)
        for lease in self.leases.values():
            if lease.run.pool == pool:
                counts[lease.state] += 1
        return counts

    def new_generation_base(self, grant: Grant) -> int:
        return grant.id << GEN_SHIFT


def _size_flag(pool: str, arena_name: str) -> str:
    """The serve flag that sizes ``pool``."""
    return "--shm-pool-size" if pool == arena_name else "--gpu-pool-size"


def _quota_flag(pool: str, arena_name: str) -> str:
    """The serve flag that bounds one stage's share of ``pool``."""
    if pool == arena_name:
        return "--max-stage-bytes (default: half of --shm-pool-size)"
    return "--gpu-pool-size (a stage may hold half of a GPU pool)"
