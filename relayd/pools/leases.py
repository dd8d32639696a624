"""Sessions, grants and leases: the daemon's single source of truth for who holds what.

Who calls what, and when (all on the daemon's event loop, never from threads):

* ``open_session`` - once per client, from the gRPC ``Attach`` handler.
* ``bind``/``close_session`` - when the client's session socket connects /
  hits EOF. EOF is how session death is detected: a SIGKILLed client's socket
  closes at once, no timeout involved.
* ``grant`` - from the gRPC ``Grant`` handler, a few times per session (a grant
  serves many leases); it may wait, fairly, for space.
* ``on_reserve``/``on_publish``/``on_sealed``/``on_claim``/``on_release``/``on_cancel``
  - per transfer, from session frames; O(1) each, no allocation in the arena.
  ``on_sealed`` is the Publish a Reserve carried (the lease was sealed while its
  Reserve still waited in the client's frame).
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

import dataclasses
import time
from collections.abc import Callable, Mapping

from relayd_client.wire.errors import (
    AbortedError,
    ErrorCode,
    InvalidArgumentError,
    PermissionDeniedError,
    StaleRefError,
)
from relayd_client.wire.framing import NOTICE_LINGER_S
from relayd_client.wire.transport import Transport

from .arena import Arena
from .crossnode import CrossNodeLeases
from .events import Freed
from .freed import FreedBatcher
from .grant_queue import GrantQueue
from .lease_table import LeaseTable
from .orphans import Orphans
from .reclaim import Aborter, Reclaimer
from .records import (
    GEN_SHIFT,
    Grant,
    Hooks,
    Lease,
    LeaseState,
    Pool,
    ReclaimReason,
    slots_for,
)
from .released import ReleaseRings
from .requests import RequestInfo, Requests
from .returns import RunReturns
from .sessions import BIND_DEADLINE, Session, Sessions


@dataclasses.dataclass(frozen=True, slots=True)
class _Reserve:
    """A Reserve the daemon makes itself (the socket fallback writes for its client)."""

    lease_id: int
    grant_id: int
    slot: int
    nslots: int
    generation: int
    request_id: str
    to_stage: str
    from_stage: str


class LeaseManager:
    """The lease table's entry point: builds its parts and runs what spans several.

    Callers that need one part use it directly: :attr:`session_table`
    (:class:`~relayd.pools.sessions.Sessions`), :attr:`queue`
    (:class:`~relayd.pools.grant_queue.GrantQueue`), :attr:`table` (the
    :class:`~relayd.pools.lease_table.LeaseTable` state machine),
    :attr:`crossnode`, :attr:`reclaim`, :attr:`freed`. ``sessions``,
    ``grants``, ``leases`` and ``requests`` are the parts' own dicts, for
    reading.
    """

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
        self.grant_slots = slots_for(grant_bytes, self.slot_size)
        self.quota_slots = max(1, stage_quota_bytes // self.slot_size)
        self.hooks = hooks or Hooks()
        self.clock = clock
        self.session_table = Sessions(max_sessions, clock)
        self.freed = FreedBatcher(freed_linger, self._deliver_freed, lambda: self.queue.space_short)
        self.returns = RunReturns(self.pools, arena.name, clock, gpu_work_may_run)
        self.queue = GrantQueue(
            self.pools,
            arena.name,
            self.session_table,
            self.freed,
            self.returns,
            grant_slots=self.grant_slots,
            quota_slots=self.quota_slots,
            max_session_grants=max_session_grants,
            max_grant_waits=max_grant_waits,
            hooks=self.hooks,
            clock=clock,
        )
        self.request_records = Requests()
        self.table = LeaseTable(
            arena,
            self.pools,
            self.session_table,
            self.request_records,
            self.queue,
            self.freed,
            self.returns,
            hooks=self.hooks,
            clock=clock,
        )
        # Release rings are read with the timer of the Freed notices they cause.
        self.releases = ReleaseRings(
            self.session_table,
            self.table.release,
            self.table.claim,
            outstanding=lambda: bool(self.table.leases),
            after=self.table.flush,
            linger=freed_linger or NOTICE_LINGER_S,
        )
        self.queue.take_releases = self.releases.take_all
        self.orphans = Orphans(self.table)
        self.crossnode = CrossNodeLeases(self.table, self.quota_slots)
        self.reclaim = Reclaimer(self.table, lease_ttl)
        self.sessions: dict[str, Session] = self.session_table.by_id
        self.grants: dict[int, Grant] = self.queue.grants
        self.leases: dict[int, Lease] = self.table.leases
        self.requests: dict[str, RequestInfo] = self.request_records.by_id
        # The calls that are one part's alone, under the names callers use.
        self.open_session = self.session_table.open
        self.authenticate = self.session_table.authenticate
        self.bind = self.session_table.bind
        self.on_reserve = self.table.on_reserve
        self.on_publish = self.table.on_publish
        self.on_sealed = self.table.on_sealed
        self.count_later = self.table.count_later
        self.count_now = self.table.count_now
        self.on_claim = self.table.on_claim
        self.on_release = self.table.on_release
        self.on_cancel = self.table.on_cancel
        self.hold = self.table.hold
        self.flush = self.table.flush
        self.release_from_peer = self.crossnode.release_from_peer
        self.abort = self.reclaim.abort
        self.check_abort = self.reclaim.check_abort
        self.narrowed_to = self.reclaim.narrowed_to
        self.abort_request = self.reclaim.abort_request
        self.start_drain = self.reclaim.start_drain
        self.drop_all = self.reclaim.drop_all

    def _deliver_freed(self, session_id: str, event: Freed) -> None:
        session = self.sessions.get(session_id)
        if session is not None and session.sink is not None:
            session.sink(event)

    # -- sessions -----------------------------------------------------------------------

    def close_session(self, session_id: str) -> None:
        """The session's connection is gone: reclaim what only it could finish."""
        self.releases.take(session_id)  # what it released before it went is released
        self.releases.detach(session_id)
        session = self.session_table.close(session_id)
        if session is None:
            return
        for lease_id in list(session.claimed):
            lease = self.leases.get(lease_id)
            if lease is not None and lease.state is LeaseState.CLAIMED:
                self.table.free(lease, ReclaimReason.READER_DIED)
        for grant in list(session.grants.values()):
            self.orphans.orphan(grant, session)
        self.freed.drop(session_id)  # after orphan(): adopting may free some
        session.grants.clear()
        session.granted_slots = 0
        session.pool_slots.clear()
        self.queue.session_closed(session)

    # -- grants -------------------------------------------------------------------------

    async def grant(
        self, session: Session, min_bytes: int, timeout: float, pool: str = Arena.name
    ) -> Grant:
        return await self.queue.grant(session, min_bytes, timeout, pool)

    def return_grant(self, session: Session, grant_id: int) -> None:
        grant = session.grants.get(grant_id)
        if grant is None:
            return
        if grant.leases:
            session.refuse(
                ErrorCode.INVALID_ARGUMENT,
                f"grant {grant_id} returned with {len(grant.leases)} leases in it",
            )
            return
        self.queue.ungrant(grant)
        self.queue.wake()

    def wake(self) -> None:
        """Serve grant waiters: pool space came back past the lease table (a push grant)."""
        self.queue.wake()

    def detach_grant(self, session: Session, grant: Grant) -> None:
        """Hand a grant's published leases to the daemon.

        The grant becomes an orphan at once: the rest of its run goes back to
        the pool now, and each lease frees its own run when read, aborted or
        expired, exactly as for a writer that died after publishing.
        """
        session.let_go(grant)
        self.orphans.orphan(grant)
        self.queue.wake()

    # -- notices (hot path) -------------------------------------------------------------

    @property
    def on_push(self) -> Callable[[Lease], None] | None:
        """Called with each lease published with Publish.push set (relayd.push)."""
        return self.table.on_push

    @on_push.setter
    def on_push(self, hook: Callable[[Lease], None] | None) -> None:
        self.table.on_push = hook

    # -- the socket fallback: the daemon writes and reads for its client -----------------

    async def put_bytes(
        self,
        session: Session,
        data: bytes,
        *,
        request_id: str,
        to_stage: str,
        from_stage: str,
        timeout: float,
    ) -> Lease:
        """Write ``data`` into a lease the daemon then holds, as for a dead writer's
        published lease: it frees its own run when read, aborted or expired."""
        if self.request_records.is_aborted(request_id):
            raise AbortedError(f"request {request_id!r} was aborted")
        grant = await self.grant(session, max(len(data), 1), timeout)
        run = grant.run
        lease_id = grant.first_lease_id()
        self.arena.write(run, data)
        self.arena.segments[run.segment].write_header(run.slot, lease_id, len(data))
        nslots = slots_for(len(data), self.slot_size)
        self.table.on_reserve(
            session,
            _Reserve(
                lease_id, grant.id, run.slot, nslots, lease_id, request_id, to_stage, from_stage
            ),
        )
        lease = self.leases[lease_id]
        self.table.published(lease, len(data), Transport.SOCKET.value)
        self.detach_grant(session, grant)
        self.flush()
        return lease

    async def read_out(
        self, session: Session, lease_id: int, generation: int, request_id: str
    ) -> bytes:
        """:meth:`get_bytes`, once a Publish that may still be lingering on its
        writer's side has come (see :mod:`relayd.pools.publish_waits`)."""
        if self.table.publish_may_come(lease_id, generation):
            await self.table.publish_waits.wait(lease_id, session.uid)
        return self.get_bytes(session, lease_id, generation, request_id)

    def get_bytes(self, session: Session, lease_id: int, generation: int, request_id: str) -> bytes:
        """Copy a published lease out for ``session`` and free it, as its reader would."""
        lease = self.leases.get(lease_id)
        if (
            lease is None
            or lease.generation != generation
            or lease.state is not LeaseState.PUBLISHED
        ):
            if self.request_records.is_aborted(request_id):
                raise AbortedError(f"request {request_id!r} was aborted")
            raise StaleRefError(
                "DataRef's lease was already read, reclaimed (TTL) or aborted; it cannot be read again"
            )
        if lease.to_stage not in session.stages:
            raise PermissionDeniedError(f"lease is addressed to stage {lease.to_stage!r}")
        self.table.claim(session, lease.id, lease.generation)
        data = self.arena.read(lease.run, lease.nbytes)
        self.table.release(session, lease.id, lease.generation)
        self.flush()
        return data

    # -- cross-node leases (relayd.pools.crossnode) ------------------------------------

    def unhold(self, lease: Lease) -> None:
        if self.table.unhold(lease):
            self.flush()

    def abort_from_peer(
        self,
        request_id: str,
        stages: tuple[str, ...] = (),
        narrow: bool = False,
        by: Aborter | None = None,
    ) -> tuple[int, tuple[str, ...] | None]:
        """A peer aborted ``request_id``: free it here too. Returns the leases freed and
        the stages the abort was narrowed to here (None: the whole request).

        The peer was authenticated and checked its session's ``stages`` when it
        knew the request; when it did not (``stages`` given), they are checked
        here (PermissionDeniedError). ``narrow``: the abort was narrowed there
        (see ``Reclaimer.narrowed_to``), and is here too, to ``stages``; else it
        is narrowed here by the same rule when the peer named the aborter
        (``by``)."""
        if narrow and not stages:
            raise InvalidArgumentError("a narrowed abort names the stages it is narrowed to")
        if by is not None and not by.stages:
            raise InvalidArgumentError("an abort that names its aborter names its stages")
        if stages:
            self.reclaim.check_abort(stages, request_id)
        to = stages if narrow else None
        if to is None and by is not None:
            to = self.reclaim.narrowed_to(by, request_id)
        return self.reclaim.abort_request(request_id, to)[0], to

    # -- abort, TTL, drain --------------------------------------------------------------

    def reap(self) -> int:
        """Expire unread leases, unbound sessions and old request records."""
        now = self.clock()
        self.releases.take_all()  # a lease claimed in a ring is being read, not forgotten
        expired = self.reclaim.expire(now)
        if self.returns and self.returns.release_fenced(now):
            self.queue.wake()
        for s in self.session_table.unbound_past(now, BIND_DEADLINE):
            self.close_session(s.id)
        self.table.early.expire(now)
        self.request_records.forget_old(now)
        self.flush()
        return expired

    # -- views for status and metrics ---------------------------------------------------

    @property
    def in_flight(self) -> int:
        return sum(1 for lease in self.leases.values() if lease.state is not LeaseState.RESERVED)

    def lease_slots(self, pool: str = Arena.name) -> int:
        return sum(lease.run.nslots for lease in self.leases.values() if lease.run.pool == pool)

    def granted_slots(self, pool: str = Arena.name) -> int:
        return sum(
            g.run.nslots for g in self.grants.values() if not g.orphan and g.run.pool == pool
        )

    def leases_by_state(self, pool: str = Arena.name) -> dict[LeaseState, int]:
        counts = dict.fromkeys(LeaseState, 0)
        for lease in self.leases.values():
            if lease.run.pool == pool:
                counts[lease.state] += 1
        return counts

    def new_generation_base(self, grant: Grant) -> int:
        return grant.id << GEN_SHIFT
