"""The writer's local allocator: leases cut from grants this session holds.

A grant is a run of arena (or GPU pool) slots the daemon handed this session;
a lease is a run inside one grant, cut here without asking the daemon. This
module owns only that bookkeeping - which grant, which slots, which lease id -
so the async and the blocking client share it and it can be tested without a
daemon. Notices, events and waiting for space stay with the clients.

Reuse is last-in first-out: a lease of the size just freed goes back into
the run freed last. A writer in steady state then copies into the same few
runs, still in cache, instead of walking its whole grant (a memcpy into a
recently used 256 KiB run took a third of the time of one into a cold run,
measured).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator

from .wire.shm import SHM_POOL
from .wire.slots import SlotAllocator

# Freed runs remembered per grant for reuse; older ones are cut first-fit.
LIFO_DEPTH = 64


class Grant:
    """One granted run of slots and the leases cut from it."""

    __slots__ = (
        "alloc", "base", "gen_base", "id", "live", "next_seq", "nslots", "pool", "recent",
        "segment",
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
        # (local start, nslots) of runs freed lately, newest last.
        self.recent: collections.deque[tuple[int, int]] = collections.deque(maxlen=LIFO_DEPTH)

    def cut(self, nslots: int) -> int | None:
        """Local start of a free run of ``nslots``: the newest freed one of that size first."""
        recent = self.recent
        for i in range(len(recent) - 1, -1, -1):
            start, count = recent[i]
            if count == nslots:
                del recent[i]
                if self.alloc.allocate_at(start, nslots):
                    return start
        return self.alloc.allocate(nslots)

    def put_back(self, local: int, nslots: int) -> None:
        self.alloc.free(local, nslots)
        self.recent.append((local, nslots))


class Lease:
    __slots__ = ("grant", "id", "local", "nslots")

    def __init__(self, grant: Grant, local: int, nslots: int, lease_id: int) -> None:
        self.grant = grant
        self.local = local
        self.nslots = nslots
        self.id = lease_id

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

    def add(self, grant: Grant) -> None:
        with self.lock:
            if grant.id in self.grants:
                raise ValueError(f"grant {grant.id} is held already")
            self.grants[grant.id] = grant

    def cut(self, nslots: int, pool: str = SHM_POOL) -> Lease | None:
        """A lease of ``nslots`` from the first grant of ``pool`` with room, or None."""
        with self.lock:
            for grant in self.grants.values():
                if grant.pool != pool:
                    continue
                local = grant.cut(nslots)
                if local is not None:
                    lease_id = grant.gen_base + grant.next_seq
                    grant.next_seq += 1
                    grant.live += 1
                    lease = Lease(grant, local, nslots, lease_id)
                    self.leases[lease_id] = lease
                    return lease
            return None

    def free(self, lease_id: int) -> Lease | None:
        """Return a lease's run to its grant; None if it is not live (freed twice)."""
        with self.lock:
            lease = self.leases.pop(lease_id, None)
            if lease is None:
                return None
            grant = lease.grant
            if self.grants.get(grant.id) is grant:
                grant.put_back(lease.local, lease.nslots)
            grant.live -= 1
            return lease

    def idle_slots(self, pool: str) -> int:
        with self.lock:
            return sum(g.nslots for g in self.grants.values() if g.live == 0 and g.pool == pool)

    def idle(self, pool: str | None = None) -> list[Grant]:
        with self.lock:
            return [g for g in self.grants.values() if g.live == 0 and pool in (None, g.pool)]

    def drop(self, grant_id: int) -> Grant | None:
        with self.lock:
            return self.grants.pop(grant_id, None)

    def clear(self) -> None:
        with self.lock:
            self.grants.clear()
            self.leases.clear()

    def __iter__(self) -> Iterator[Grant]:
        with self.lock:
            return iter(list(self.grants.values()))
