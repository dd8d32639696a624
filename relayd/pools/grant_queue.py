"""The grant queue: who gets which run of slots, in what order, within which quotas.

A session asks for a grant (a run of slots it cuts leases from) a few times
in its life. Requests are served first come, first served per pool, up to the
caller's timeout: a small request does not overtake an older large one in the
same pool, but one waiting on its own stage's quota blocks nobody else, and a
full GPU pool does not hold up waiters of the arena. Per-stage quotas are
summed over every session serving the stage, so a stage cannot take the node
by opening more sessions; a session holds at most ``max_session_grants``
grants and waits in at most ``max_grant_waits`` calls at once.

When a request has to wait, nothing that would free space may linger: the
pending Freed notices go at once and every other session is asked to return
idle grants (a :class:`~relayd.pools.events.Reclaim` event).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Callable, Mapping

from relayd_client.wire.errors import (
    DrainingError,
    InvalidArgumentError,
    ResourceExhaustedError,
    SessionClosedError,
)
from relayd_client.wire.shm import MAX_GRANT_ID

from .events import Reclaim
from .freed import FreedBatcher
from .records import Grant, Hooks, Pool, slots_for
from .returns import RunReturns
from .sessions import Session, Sessions, SessionState


@dataclasses.dataclass(eq=False)
class _Waiter:
    session: Session
    nslots: int
    future: asyncio.Future[Grant]
    since: float
    pool: str


class GrantQueue:
    def __init__(
        self,
        pools: Mapping[str, Pool],
        arena_name: str,
        sessions: Sessions,
        freed: FreedBatcher,
        returns: RunReturns,
        *,
        grant_slots: int,
        quota_slots: int,
        max_session_grants: int,
        max_grant_waits: int,
        hooks: Hooks,
        clock: Callable[[], float],
    ) -> None:
        self.pools = pools
        self.arena_name = arena_name
        self.sessions = sessions
        self.freed = freed
        self.returns = returns
        self.grant_slots = grant_slots
        self.quota_slots = quota_slots
        self.max_session_grants = max_session_grants
        self.max_grant_waits = max_grant_waits
        self.hooks = hooks
        self.clock = clock
        # Every live grant by id: the sessions', orphans', pulls' and landed pushes'.
        self.grants: dict[int, Grant] = {}
        self.draining = False
        self._next_grant = 1
        self._waiters: collections.deque[_Waiter] = collections.deque()
        # Judges what readers left in their Release rings (set by the lease manager).
        self.take_releases: Callable[[], object] = lambda: None

    def new_id(self) -> int:
        """An id no live grant has, counted up to MAX_GRANT_ID and then from 1 again.

        Every landed push and every pull takes one, so a busy node counts
        through 2**31 of them in days; a larger id would number its leases into
        the bit a Release ring marks claims with, or beyond 64 bits. Ids come
        round only after that many grants, long after any DataRef of the first
        grant with the id expired.
        """
        for _ in range(len(self.grants) + 1):
            gid = self._next_grant
            self._next_grant = gid + 1 if gid < MAX_GRANT_ID else 1
            if gid not in self.grants:
                return gid
        raise RuntimeError("every grant id is live")  # more live grants than ids: unreachable

    @property
    def space_short(self) -> bool:
        """Whether some grant request waits for space."""
        return bool(self._waiters) and any(not w.future.done() for w in self._waiters)

    async def grant(self, session: Session, min_bytes: int, timeout: float, pool: str) -> Grant:
        """A grant of at least ``min_bytes`` (the default grant size if the pool has room)."""
        if self.draining:
            raise DrainingError("daemon is draining; no new reservations")
        if min_bytes < 0:
            raise InvalidArgumentError("min_bytes must be >= 0")
        # Releases in readers' rings free space the writer may need: judge them
        # first, so what they free is told below rather than waited for.
        self.take_releases()
        if self.freed.pending(session.id):
            # A writer asks for space only when its grants are full: what
            # readers freed in them (batched, see relayd.pools.freed) may be enough.
            self.freed.send([session.id])
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
        slot_size = arena.slot_size
        need = slots_for(min_bytes, slot_size)
        if need > arena.max_run_slots():
            raise ResourceExhaustedError(
                f"{min_bytes} bytes exceed the largest possible run in {pool} "
                f"({arena.max_run_slots() * slot_size} bytes); raise "
                f"{self._size_flag(pool)} (and --shm-segment-size for the arena)"
            )
        if need > self.quota(pool):
            raise ResourceExhaustedError(
                f"{min_bytes} bytes exceed the per-stage quota of "
                f"{self.quota(pool) * slot_size} bytes in {pool}; raise "
                f"{self._quota_flag(pool)}"
            )
        nslots = max(need, self.grant_slots)
        # Shrink the default grant when the pool is tight rather than wait for
        # it, and to what the stage's quota leaves: a default grant larger than
        # the quota (--grant-size above --max-stage-bytes) would wait forever.
        if nslots > need and arena.largest_free_run() < nslots:
            nslots = need
        if nslots > need:
            nslots = max(need, min(nslots, self.stage_room(session, pool)))
        return await self.wait(session, nslots, timeout, pool)

    async def wait(self, session: Session, nslots: int, timeout: float, pool: str) -> Grant:
        """A grant of exactly ``nslots``, waiting fairly up to ``timeout`` for them."""
        arena = self.pools[pool]
        start = self.clock()
        granted = self.take(session, nslots, pool)
        if granted is not None and not any(w.pool == pool for w in self._waiters):
            self.hooks.reserve_wait(0.0)
            return granted
        if granted is not None:  # someone waits already: fairness first
            self.ungrant(granted)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(session, nslots, loop.create_future(), start, pool)
        self._waiters.append(waiter)
        self.wake()
        if not waiter.future.done():
            self.freed.send()
            self.sessions.tell_all(Reclaim(), skip=session)
        try:
            grant = await asyncio.wait_for(asyncio.shield(waiter.future), timeout=max(timeout, 0.0))
        except TimeoutError:
            if _granted(waiter):
                grant = waiter.future.result()  # granted in the same tick as the timeout
            else:
                waiter.future.cancel()
                self._drop_waiter(waiter)
                raise ResourceExhaustedError(
                    f"no {nslots * arena.slot_size} byte run became free within {timeout:.3g}s "
                    f"({pool} {arena.used_bytes}/{arena.capacity_bytes} bytes in use)"
                ) from None
        except asyncio.CancelledError:
            if _granted(waiter) and self._live(waiter.future.result()):
                self.ungrant(waiter.future.result())
            waiter.future.cancel()
            self._drop_waiter(waiter)
            raise
        if not self._live(grant):
            # Served, then its session closed before this call resumed: the close
            # gave the run back, and it may be another session's grant by now.
            raise SessionClosedError("session closed while waiting")
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # Cancelled in the turn it was served: before Python 3.12 wait_for
            # answers that cancel with the result, which the caller (a gRPC call
            # that ended) would hand to nobody, and the session could never give
            # back a grant whose id it never learnt.
            self.ungrant(grant)
            self.wake()
            raise asyncio.CancelledError
        self.hooks.reserve_wait(self.clock() - start)
        return grant

    def _live(self, grant: Grant) -> bool:
        """Whether ``grant`` is still its session's (not orphaned by a close since)."""
        return self.grants.get(grant.id) is grant and not grant.orphan

    def _drop_waiter(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass
        self.wake()

    def quota(self, pool: str) -> int:
        """One stage's share of ``pool``, in slots."""
        # The stage quota is sized for the arena; a GPU pool holds at most half its own size.
        if pool == self.arena_name:
            return self.quota_slots
        p = self.pools[pool]
        return max(1, p.capacity_bytes // p.slot_size // 2)

    def stage_room(self, session: Session, pool: str) -> int:
        """Slots the session may still be granted before one of its stages hits its quota.

        O(sessions), on grants only.
        """
        held = max((self.sessions.stage_slots(st, pool) for st in session.stages), default=0)
        return self.quota(pool) - held

    def take(self, session: Session, nslots: int, pool: str) -> Grant | None:
        """A grant of ``nslots`` now, if the pool and the stage's quota have room."""
        if session.state is SessionState.CLOSED:
            raise SessionClosedError("session closed")
        if nslots > self.stage_room(session, pool):
            return None
        run = self.pools[pool].allocate(nslots)
        if run is None:
            return None
        grant = Grant(self.new_id(), session.id, run)
        self.grants[grant.id] = grant
        session.hold(grant)
        return grant

    def ungrant(self, grant: Grant) -> None:
        """An unused grant goes back whole."""
        session = self.sessions.get(grant.session_id)
        if session is not None:
            session.let_go(grant)
        self.grants.pop(grant.id, None)
        self.returns.free(grant.run)

    def wake(self) -> None:
        """Serve waiters in arrival order; one blocked on its own quota doesn't block others."""
        while self._waiters and self._waiters[0].future.done():
            self._waiters.popleft()
        full: set[str] = set()
        for waiter in list(self._waiters):
            if waiter.future.done() or waiter.pool in full:
                continue
            s = waiter.session
            if s.state is SessionState.CLOSED:
                # Woken by what its own close frees, before session_closed():
                # it fails as it would there, and take() must not raise into that close.
                waiter.future.set_exception(SessionClosedError("session closed while waiting"))
                continue
            if waiter.nslots > self.stage_room(s, waiter.pool):
                continue
            grant = self.take(s, waiter.nslots, waiter.pool)
            if grant is None:
                # The pool is full for its oldest waiter: nobody overtakes it
                # there, but waiters on other pools are still served.
                full.add(waiter.pool)
                continue
            waiter.future.set_result(grant)
            self._waiters.remove(waiter)

    def session_closed(self, session: Session) -> None:
        """``session`` is gone: its waits fail, and what it held may serve others."""
        for w in self._waiters:
            if w.session is session and not w.future.done():
                w.future.set_exception(SessionClosedError("session closed while waiting"))
        self.wake()

    def drain(self) -> None:
        """No new grants; every wait fails now."""
        self.draining = True
        for w in self._waiters:
            if not w.future.done():
                w.future.set_exception(DrainingError("daemon is draining"))
        self._waiters.clear()

    def _size_flag(self, pool: str) -> str:
        """The serve flag that sizes ``pool``."""
        return "--shm-pool-size" if pool == self.arena_name else "--gpu-pool-size"

    def _quota_flag(self, pool: str) -> str:
        """The serve flag that bounds one stage's share of ``pool``."""
        if pool == self.arena_name:
            return "--max-stage-bytes (default: half of --shm-pool-size)"
        return "--gpu-pool-size (a stage may hold half of a GPU pool)"


def _granted(waiter: _Waiter) -> bool:
    f = waiter.future
    return f.done() and not f.cancelled() and f.exception() is None
