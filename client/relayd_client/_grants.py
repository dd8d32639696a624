"""The writer's local allocator: leases cut from grants this session holds.

A grant is a run of arena (or GPU pool) slots the daemon handed this session;
a lease is a run inside one grant, cut here without asking the daemon. This
module owns only that bookkeeping - which grant, which slots, which lease id -
so the async and the blocking client share it and it can be tested without a
daemon.

:class:`Grants` is the wait policy on top: a put short of space returns idle
grants, flushes its lingering notices and asks for one grant (every put short
of space in that pool waits on the same call), then takes whichever comes
first - that grant, or space freed by readers. It talks to the daemon only
through a :class:`GrantSource`, so it is unit-tested with a fake one.

Reuse is last-in first-out across the grants held: a lease of the size just
freed goes back into a run freed lately, whichever grant it is in. A writer in
steady state then copies into the same few runs, still in cache, instead of
walking its grants: a memcpy into a 256 KiB run still in cache takes about a
third of the time of one into a cold run. Per grant, a grant that still had
room was cut first-fit before a newer run freed in the next one was looked at.
The run freed last, except up to :data:`BEHIND_NEWEST_MAX` bytes of the
arena: there the one before it, since the newest was read last, by a reader on
another core that still holds its cache lines (see :meth:`Grants._cut`).

A run comes back as soon as its reader has marked the lease read in its slot
header (:meth:`LeaseTable.reclaim_read`), not when the daemon's Freed comes:
the daemon takes Releases only when it is awake anyway, and while a writer
waited for that (then up to 16 MiB of transfers) it walked through 18 runs of
1 MiB, 70 of 256 KiB. The daemon frees the lease when the Reserve over it
comes (``relayd.pools.lease_table``); until its Freed confirms that, the
lease's grant is not idle, so it is never given back with it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

from .wire.errors import RelayError, ResourceExhaustedError
from .wire.rings import IdRing
from .wire.shm import MAX_LEASE_SEQ, SHM_POOL
from .wire.slots import SlotAllocator

if TYPE_CHECKING:
    from .wire.proto import relay_pb2 as pb
    from .wire.shm import MappedSegment

# Freed runs kept aside for reuse by a lease of the same size, newest first;
# beyond this many, the oldest goes back to its grant's allocator.
LIFO_DEPTH = 64
# An arena lease of at most this many bytes is cut from the newest run but one
# of its size kept aside (see Grants._cut); a larger one from the newest.
BEHIND_NEWEST_MAX = 512 << 10
# Sealed leases whose headers a writer watches for its reader's mark, newest
# last; an older one comes back with the daemon's Freed. A stop-and-wait writer
# needs one, a writer of 16 streams about as many.
WATCH_DEPTH = 16
# Idle grants a session keeps, in default grants' worth of slots (or one
# larger grant): a Freed notice can trail the reader's ack, and a new grant
# costs a gRPC round trip (~1 ms, half a 16 MiB copy). The daemon asks for
# them back under pressure.
IDLE_GRANTS = 4
# A grant wait that ends this close to its deadline ran out of time; earlier,
# the daemon refused it.
DEADLINE_SLACK_S = 0.01


class Grant:
    """One granted run of slots and the leases cut from it."""

    __slots__ = (
        "alloc", "base", "gen_base", "id", "live", "next_seq", "nslots", "pool", "segment",
        "unconfirmed",
    )  # fmt: skip

    def __init__(
        self, grant_id: int, segment: int, base: int, nslots: int, gen_base: int, pool: str
    ) -> None:
        self.id = grant_id
        self.segment = segment
        self.base = base
        self.nslots = nslots
        self.gen_base = gen_base
        self.pool = pool or SHM_POOL
        self.alloc = SlotAllocator(nslots)
        self.next_seq = 1
        self.live = 0
        # Leases taken back on their reader's mark whose Freed has not come:
        # the daemon may still count them, so the grant is not idle.
        self.unconfirmed = 0

    @property
    def idle(self) -> bool:
        return self.live == 0 and self.unconfirmed == 0

    @property
    def spent(self) -> bool:
        """Whether it has numbered its last lease id: the next would run into the
        grant's own bits, and the daemon ends a session that uses such an id."""
        return self.next_seq > MAX_LEASE_SEQ


class HoldsBack(Protocol):
    """Where a lingering notice counts the bytes it holds back (the session's
    pending frame, :meth:`~relayd_client._session.SessionChannel.taken_back`)."""

    def taken_back(self, frame: pb.SessionFrame, nbytes: int) -> None: ...


class Lease:
    __slots__ = ("grant", "held", "id", "local", "nslots", "reserve")

    def __init__(self, grant: Grant, local: int, nslots: int, lease_id: int) -> None:
        self.grant = grant
        self.local = local
        self.nslots = nslots
        self.id = lease_id
        # The lease's Reserve notice and the pending frame it waits in, for the
        # Publish to ride in it (relayd_client._notices); None once it cannot.
        self.reserve: tuple[pb.SessionFrame, pb.Reserve] | None = None
        # Where its lingering Publish counts its bytes as held back, the frame
        # it waits in and how many (relayd_client._notices); None once taken
        # back. Left set when that frame goes: taken_back then finds it gone.
        self.held: tuple[HoldsBack, pb.SessionFrame, int] | None = None

    @property
    def slot(self) -> int:
        return self.grant.base + self.local


class LeaseTable:
    """Grants and live leases of one session; every method runs under :attr:`lock`.

    The lock is re-entrant and cheap; callers hold it only for bookkeeping,
    never during a copy, so writers on several threads cut leases in turn
    and copy in parallel.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.grants: dict[int, Grant] = {}
        self.leases: dict[int, Lease] = {}
        # (grant, local start, nslots) of runs freed lately, newest last, kept
        # aside: their grant's allocator still counts them taken, so a put of
        # the same size takes one back without a trip through the allocator
        # (freeing and re-taking a run there cost ~5 us a put, measured). Only
        # runs of grants held: drop() and clear() take a grant's runs with it.
        self.recent: collections.deque[tuple[Grant, int, int]] = collections.deque()
        # Sealed arena leases and the segment their header is in, oldest first
        # (see reclaim_read), and the ids taken back there, by grant, until the
        # daemon's Freed of each comes (see freed).
        self.watched: collections.deque[tuple[Lease, MappedSegment, int]] = collections.deque()
        self.unconfirmed: dict[int, Grant] = {}

    def add(self, grant: Grant) -> None:
        with self.lock:
            if grant.id in self.grants:
                raise ValueError(f"grant {grant.id} is held already")
            self.grants[grant.id] = grant

    def cut(self, nslots: int, pool: str = SHM_POOL, *, newest: bool = True) -> Lease | None:
        """A lease of ``nslots`` of ``pool``: the newest freed run of that size
        kept aside, else first fit in the first grant with room; None if none
        has room. ``newest=False``: the newest such run is left for a later cut
        (while it is the only one, a second is cut first fit; if none fits, the
        newest is taken after all)."""
        with self.lock:
            found = self._reuse(nslots, pool, 0 if newest else 1) or self._first_fit(nslots, pool)
            if found is None and not newest:  # nothing else fits: the newest after all
                found = self._reuse(nslots, pool, 0)
            if found is None and self.recent:
                self.unpark()  # runs of other sizes, kept aside: coalesced, they may fit
                found = self._first_fit(nslots, pool)
            if found is None:
                return None
            grant, local = found
            lease_id = grant.gen_base + grant.next_seq
            grant.next_seq += 1
            grant.live += 1
            lease = Lease(grant, local, nslots, lease_id)
            self.leases[lease_id] = lease
            return lease

    def _reuse(self, nslots: int, pool: str, behind: int) -> tuple[Grant, int] | None:
        """The run kept aside of ``nslots`` in a grant of ``pool`` with ``behind``
        newer ones of that size left where they are."""
        recent = self.recent
        for i in range(len(recent) - 1, -1, -1):
            grant, local, count = recent[i]
            if count != nslots or grant.pool != pool:
                continue
            if grant.spent:
                del recent[i]
                grant.alloc.free(local, count)  # it cuts no more leases
            elif behind:
                behind -= 1
            else:
                del recent[i]
                return grant, local
        return None

    def _first_fit(self, nslots: int, pool: str) -> tuple[Grant, int] | None:
        for grant in self.grants.values():
            if grant.pool == pool and not grant.spent:
                local = grant.alloc.allocate(nslots)
                if local is not None:
                    return grant, local
        return None

    def free(self, lease_id: int) -> Lease | None:
        """Put a lease's run aside for reuse; None if it is not live (freed twice)."""
        with self.lock:
            lease = self.leases.pop(lease_id, None)
            if lease is None:
                return None
            grant = lease.grant
            if self.grants.get(grant.id) is grant:
                recent = self.recent
                if len(recent) >= LIFO_DEPTH:
                    oldest, local, count = recent.popleft()
                    oldest.alloc.free(local, count)
                recent.append((grant, lease.local, lease.nslots))
            grant.live -= 1
            return lease

    def watch(self, lease: Lease, seg: MappedSegment, mark: int) -> None:
        """Look for ``mark``, the read mark of ``lease`` just sealed in ``seg``
        (:func:`~relayd_client.wire.shm.read_mark` of its object id), from now on.

        Only a lease whose Publish rode in its Reserve, to a daemon that takes a
        Reserve over a read lease (:meth:`Notices.publish
        <relayd_client._notices.Notices.publish>` says which): the daemon judges a
        frame's Reserves before its Publishes, and takes a Reserve over a read
        lease only once it is published; an older one's writers wait for Freed.
        """
        with self.lock:
            watched = self.watched
            if len(watched) >= WATCH_DEPTH:
                watched.popleft()
            watched.append((lease, seg, mark))

    def reclaim_read(self) -> int:
        """Take back the watched leases whose reader marked them read; how many.

        Each goes aside for reuse as a freed one does (:meth:`free`), and stays
        counted against its grant until the daemon's Freed of it comes.
        """
        with self.lock:
            watched = self.watched
            taken = 0
            for _ in range(len(watched)):
                entry = watched.popleft()
                lease, seg, mark = entry
                if self.leases.get(lease.id) is not lease:
                    continue  # freed by the daemon meanwhile (or its grant dropped)
                try:
                    read = seg.read_marked(lease.slot, mark)
                except ValueError:  # unmapped: a re-attach took its session's leases
                    continue
                if not read:
                    watched.append(entry)
                    continue
                self.free(lease.id)
                held, lease.held = lease.held, None
                if held is not None:  # its Publish lingers on, but holds nothing back now
                    held[0].taken_back(held[1], held[2])
                lease.grant.unconfirmed += 1
                self.unconfirmed[lease.id] = lease.grant
                taken += 1
            return taken

    def confirm(self, lease_id: int) -> Grant | None:
        """The daemon freed ``lease_id``, taken back here on its reader's mark
        already: its grant, held still, or None if it was not such a lease."""
        with self.lock:
            grant = self.unconfirmed.pop(lease_id, None)
            if grant is None:
                return None
            grant.unconfirmed -= 1
            return grant if self.grants.get(grant.id) is grant else None

    def unpark(self) -> None:
        """Give every run kept aside back to its grant's allocator."""
        with self.lock:
            for grant, local, count in self.recent:
                grant.alloc.free(local, count)
            self.recent.clear()

    def idle_slots(self, pool: str) -> int:
        with self.lock:
            return sum(g.nslots for g in self.grants.values() if g.idle and g.pool == pool)

    def idle(self, pool: str | None = None) -> list[Grant]:
        with self.lock:
            return [g for g in self.grants.values() if g.idle and pool in (None, g.pool)]

    def drop(self, grant_id: int) -> Grant | None:
        with self.lock:
            grant = self.grants.pop(grant_id, None)
            if grant is not None and self.recent:
                self.recent = collections.deque(e for e in self.recent if e[0] is not grant)
            return grant

    def clear(self) -> None:
        with self.lock:
            self.grants.clear()
            self.leases.clear()
            self.recent.clear()
            self.watched.clear()
            self.unconfirmed.clear()

    def __iter__(self) -> Iterator[Grant]:
        with self.lock:
            return iter(list(self.grants.values()))


class GrantSource(Protocol):
    """What the grant wait needs from the session."""

    async def request_grant(self, min_bytes: int, timeout: float, pool: str) -> Grant:
        """A new grant of at least ``min_bytes``, validated; raises the daemon's refusal."""
        ...

    def return_grant(self, grant_id: int) -> None:
        """Queue the notice that gives an idle grant back."""
        ...

    def flush(self) -> None:
        """Send the lingering notices now."""
        ...


class GrantCall:
    """A Grant call in flight for one pool; every put short of space waits on it."""

    __slots__ = ("ended", "nslots", "task", "until")

    def __init__(self, task: asyncio.Task[Grant], nslots: int, until: float) -> None:
        self.task = task
        self.nslots = nslots  # what it asked for
        self.until = until  # its own deadline (monotonic)
        self.ended = until
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[Grant]) -> None:
        self.ended = time.monotonic()
        if not task.cancelled():  # the put that started it may have given up: seen here
            task.exception()

    def refused(self, nslots: int) -> bool:
        """Did the daemon say no to this ask, not merely run out of time waiting?

        A refusal before the call's deadline means no amount of waiting makes
        room (beyond the stage quota or the largest run), so it holds for any
        put of at least the size asked.
        """
        exc = self.task.exception()
        return (
            isinstance(exc, ResourceExhaustedError)
            and self.ended < self.until - DEADLINE_SLACK_S
            and self.nslots <= nslots
        )


class Grants:
    """Leases for puts: cut from held grants, or wait for a new grant or freed space.

    ``check_open`` raises when the session is gone; a waiting put calls it
    each time it wakes, so losing the daemon fails the wait at once
    (:meth:`wake` is called then). :attr:`wake` is what a freed run calls;
    a client whose frees may come from other threads replaces it with a
    thread-safe one.
    """

    def __init__(
        self, table: LeaseTable, source: GrantSource, check_open: Callable[[], object]
    ) -> None:
        self.table = table
        self.source = source
        self.check_open = check_open
        self.space = asyncio.Event()
        self.calls: dict[str, GrantCall] = {}  # by pool, the arena included
        self.slot_size = 1
        self.idle_budget = 0  # idle slots kept per pool; 0 until attached
        self.wake: Callable[[], None] = self.space.set
        self.ring: IdRing | None = None  # the daemon's Freed ring, while attached

    def configure(self, slot_size: int, default_grant_bytes: int) -> None:
        """The session's slot size and default grant size (at every attach)."""
        self.slot_size = max(slot_size, 1)
        self.idle_budget = IDLE_GRANTS * max(default_grant_bytes // self.slot_size, 1)

    def nslots(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.slot_size))

    def cut(self, nbytes: int, pool: str = SHM_POOL) -> Lease | None:
        """A lease for ``nbytes`` from a grant held, or None: never waits."""
        self.collect()
        return self._cut(self.nslots(nbytes), pool)

    def _cut(self, nslots: int, pool: str) -> Lease | None:
        """:meth:`LeaseTable.cut`, from the newest run of that size kept aside
        but one for an arena lease of up to :data:`BEHIND_NEWEST_MAX` bytes.

        Such a run was read last by a reader on another core, whose cache still
        holds it: a copy into it takes every line back from there first. The
        run freed before it has gone on to the shared cache. In stop-and-wait
        between two processes, a put into the newest but one took 58-61 us at
        256 KiB (its copy 14-17) and 73-76 at 512 KiB, against 69-70 (24-26)
        and 82-88 into the newest; the reader's get was 0-4 us slower. At 1 MiB
        the put gained little and the get lost 5-25 us; at 4 MiB the copy took
        213-266 us against 148-175 (two runs outgrow the cache). A GPU pool's
        runs are no host memory: the newest.
        """
        newest = pool != SHM_POOL or nslots * self.slot_size > BEHIND_NEWEST_MAX
        return self.table.cut(nslots, pool, newest=newest)

    def collect(self) -> None:
        """Give back the arena runs the daemon's ring says are free.

        Runs on whichever thread cuts next, and wakes nobody unless a put
        waits for space (that is the point of the ring).
        """
        table = self.table
        if table.watched and table.reclaim_read() and self.waiting():
            self.wake()
        ring = self.ring
        if ring is None:
            return
        try:
            if not ring.ready():
                return
            with table.lock:
                freed = [self.freed(lease_id) for lease_id in ring.take()]
                for lease in freed:
                    if lease is not None and lease.grant.pool == SHM_POOL:
                        self._put_back(lease)
        except ValueError:  # a re-attach closed the ring: its leases went with the session
            return
        if self.waiting():
            self.wake()

    def waiting(self) -> bool:
        """Whether a put waits for space (a call's entry may outlive its wait)."""
        return any(not call.task.done() for call in self.calls.values())

    async def reserve(self, nbytes: int, deadline: float, pool: str = SHM_POOL) -> Lease:
        """A lease for ``nbytes`` of ``pool``, waiting up to ``deadline`` (monotonic)."""
        self.check_open()
        nslots = self.nslots(nbytes)
        while True:
            self.collect()
            lease = self._cut(nslots, pool)
            if lease is not None:
                return lease
            self.check_open()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ResourceExhaustedError(
                    f"no space for {nbytes} bytes before the deadline (readers may be slow)"
                )
            call = self.calls.get(pool)
            if call is None or call.task.done():
                # No idle grant could take this lease, so none is worth keeping
                # against our quota while we ask for a bigger one. And our
                # lingering publishes go first: readers' releases of those
                # leases wait for them in the daemon, and they may be the space.
                self.return_idle(pool)
                self.source.flush()
                task = asyncio.get_running_loop().create_task(
                    self._request(nslots * self.slot_size, remaining, pool)
                )
                call = self.calls[pool] = GrantCall(task, nslots, deadline)
            task = call.task
            self.space.clear()
            space = asyncio.ensure_future(self.space.wait())
            try:
                done, _ = await asyncio.wait(
                    {task, space}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                space.cancel()
            if task in done:
                if self.calls.get(pool) is call:
                    del self.calls[pool]
                exc = task.exception()
                # A grant that timed out for a put with a shorter deadline is
                # retried; a timeout within our own deadline, a refusal of
                # this size or any other error is ours.
                if exc is not None and (
                    not isinstance(exc, ResourceExhaustedError)
                    or call.refused(nslots)
                    or time.monotonic() >= deadline - DEADLINE_SLACK_S
                ):
                    lease = self._cut(nslots, pool)
                    if lease is not None:
                        return lease
                    raise exc

    async def _request(self, min_bytes: int, timeout: float, pool: str) -> Grant:
        grant = await self.source.request_grant(min_bytes, timeout, pool)
        # Registered here, once, however many puts were waiting on this task.
        self.add(grant)
        return grant

    def add(self, grant: Grant) -> None:
        try:
            self.table.add(grant)
        except ValueError:
            raise RelayError(f"daemon granted run {grant.id} twice") from None
        self.space.set()

    def freed(self, lease_id: int) -> Lease | None:
        """The live lease a Freed of the daemon names; None if there is none:
        freed twice, or taken back on its reader's mark already, which the Freed
        confirms (its grant may be idle now)."""
        table = self.table
        with table.lock:
            lease = table.leases.get(lease_id)
            if lease is None:
                grant = table.confirm(lease_id)
                if grant is not None:
                    self._give_back_if_idle(grant)
            return lease

    def slots_back(self, lease: Lease) -> None:
        """A lease's run is free again (its reader's Freed notice, or a cancel)."""
        if self._put_back(lease):
            self.wake()

    def _put_back(self, lease: Lease) -> bool:
        """Free ``lease`` in the table, and give its grant back if it is idle and
        spent, or idle beyond the budget."""
        table = self.table
        with table.lock:
            if table.free(lease.id) is None:
                return False
            self._give_back_if_idle(lease.grant)
        return True

    def _give_back_if_idle(self, grant: Grant) -> None:
        """Give ``grant`` back if it is idle and spent, or idle beyond the budget."""
        with self.table.lock:
            budget = self.idle_budget
            # At least the grant itself: a writer of payloads beyond the budget
            # keeps one grant that fits them, not a Grant call per put.
            if grant.idle and (
                grant.spent
                or (budget and self.table.idle_slots(grant.pool) > max(budget, grant.nslots))
            ):
                self.give_back(grant)

    def give_back(self, grant: Grant) -> None:
        with self.table.lock:
            self.table.drop(grant.id)
            self.source.return_grant(grant.id)

    def return_idle(self, pool: str | None = None) -> None:
        with self.table.lock:
            for g in self.table.idle(pool):
                self.give_back(g)

    def detach(self, pool: str) -> GrantCall | None:
        """Take ``pool``'s call in flight out of the table (a re-attach lets it fail by itself)."""
        return self.calls.pop(pool, None)

    async def cancel_calls(self) -> None:
        calls = list(self.calls.values())
        self.calls.clear()
        for call in calls:
            call.task.cancel()
        for call in calls:
            with contextlib.suppress(BaseException):
                await call.task
