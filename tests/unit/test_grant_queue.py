"""The grant queue on its own (a real, small arena; no lease table): order, quotas, limits."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from relayd_client import DrainingError, ResourceExhaustedError, SessionClosedError
from relayd_client.wire.rings import CLAIM_BIT
from relayd_client.wire.shm import LEASE_SEQ_BITS, MAX_GRANT_ID

from relayd.pools.arena import Arena
from relayd.pools.events import Freed, Reclaim, SessionEvent
from relayd.pools.freed import FreedBatcher
from relayd.pools.grant_queue import GrantQueue
from relayd.pools.records import Hooks
from relayd.pools.returns import RunReturns
from relayd.pools.sessions import Session, Sessions
from tests.unit._pools import SLOT, unit_arena

NSLOTS = 32


@pytest.fixture
def arena() -> Iterator[Arena]:
    with unit_arena(NSLOTS) as a:
        yield a


class World:
    """A queue over ``arena`` and the sessions asking it, each with its events."""

    def __init__(self, arena: Arena, *, quota: int = NSLOTS, grant: int = 4, **kw: int) -> None:
        self.arena = arena
        self.sessions = Sessions(16, lambda: 0.0)
        self.events: dict[str, list[SessionEvent]] = {}
        self.waits: list[float] = []
        self.freed = FreedBatcher(0.0, lambda sid, ev: self.sessions.by_id[sid].tell(ev))
        self.queue = GrantQueue(
            {arena.name: arena}, arena.name, self.sessions, self.freed,
            RunReturns({arena.name: arena}, arena.name, lambda: 0.0),
            grant_slots=grant, quota_slots=quota, max_session_grants=kw.get("grants", 64),
            max_grant_waits=kw.get("waits", 4), hooks=Hooks(reserve_wait=self.waits.append),
            clock=lambda: 0.0,
        )  # fmt: skip

    def session(self, stage: str) -> Session:
        s = self.sessions.open(pid=1, stages=[stage])
        events = self.events[s.id] = []
        return self.sessions.bind(s.id, s.token, events.append, pid=1, uid=0, gid=0)


def test_waiters_are_served_in_arrival_order_per_pool(arena: Arena) -> None:
    w = World(arena)
    a, b, c = w.session("a"), w.session("b"), w.session("c")

    async def scenario() -> None:
        big = await w.queue.grant(a, 24 * SLOT, 1.0, arena.name)
        first = asyncio.ensure_future(w.queue.grant(b, 16 * SLOT, 5.0, arena.name))
        await asyncio.sleep(0)
        # 8 slots are free: enough for c, but b came first and needs 16.
        second = asyncio.ensure_future(w.queue.grant(c, SLOT, 5.0, arena.name))
        await asyncio.sleep(0)
        assert not first.done() and not second.done()
        w.queue.ungrant(big)
        w.queue.wake()
        assert (await first).run.nslots == 16
        assert (await second).run.nslots == 4  # the default grant: the pool has room

    asyncio.run(asyncio.wait_for(scenario(), 5))
    assert w.waits[0] == 0.0 and len(w.waits) == 3  # one wait observed per grant


def test_a_waiter_held_by_its_own_stage_quota_does_not_block_others(arena: Arena) -> None:
    w = World(arena, quota=8)
    a1, a2, b = w.session("a"), w.session("a"), w.session("b")

    async def scenario() -> None:
        held = await w.queue.grant(a1, 8 * SLOT, 1.0, arena.name)  # stage a's whole quota
        # The quota is per stage, summed over its sessions: a2 waits for a1.
        blocked = asyncio.ensure_future(w.queue.grant(a2, SLOT, 5.0, arena.name))
        await asyncio.sleep(0)
        assert not blocked.done()
        # b's stage has room and the pool too: served at once, past the waiter.
        assert (await w.queue.grant(b, 2 * SLOT, 1.0, arena.name)).run.nslots == 4
        assert not blocked.done()
        w.queue.ungrant(held)
        w.queue.wake()
        assert (await blocked).run.nslots == 1  # what the stage had left when it queued

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_a_request_beyond_the_stage_quota_is_refused_not_queued(arena: Arena) -> None:
    w = World(arena, quota=8)
    a = w.session("a")
    with pytest.raises(ResourceExhaustedError, match="per-stage quota of 524288 bytes"):
        asyncio.run(w.queue.grant(a, 9 * SLOT, 1.0, arena.name))
    with pytest.raises(ResourceExhaustedError, match="largest possible run"):
        asyncio.run(w.queue.grant(a, (NSLOTS + 1) * SLOT, 1.0, arena.name))


def test_grant_ids_come_round_after_the_last_one_past_those_still_live(arena: Arena) -> None:
    w = World(arena, grant=1)
    a = w.session("a")

    async def scenario() -> list[int]:
        live = await w.queue.grant(a, SLOT, 1.0, arena.name)
        assert live.id == 1
        w.queue._next_grant = MAX_GRANT_ID - 1
        ids = [(await w.queue.grant(a, SLOT, 1.0, arena.name)).id for _ in range(3)]
        return ids

    ids = asyncio.run(asyncio.wait_for(scenario(), 5))
    assert ids == [MAX_GRANT_ID - 1, MAX_GRANT_ID, 2]  # 1 is still a's
    # Every lease id of each fits the 64 bits of the wire, with the ring's claim bit clear.
    assert all((gid << LEASE_SEQ_BITS | (1 << LEASE_SEQ_BITS) - 1) < CLAIM_BIT for gid in ids)


def test_the_default_grant_shrinks_when_the_pool_is_tight(arena: Arena) -> None:
    w = World(arena, grant=8)
    a, b = w.session("a"), w.session("b")

    async def scenario() -> None:
        await w.queue.grant(a, 29 * SLOT, 1.0, arena.name)
        # 3 slots left: a one-slot request gets one, not a default grant that would wait.
        assert (await w.queue.grant(b, SLOT, 1.0, arena.name)).run.nslots == 1

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_a_wait_sends_pending_freed_and_asks_every_other_session_to_reclaim(
    arena: Arena,
) -> None:
    w = World(arena)
    a, b, reader = w.session("a"), w.session("b"), w.session("reader")
    w.freed.linger = 60.0  # would linger a minute

    async def scenario() -> None:
        await w.queue.grant(a, 30 * SLOT, 1.0, arena.name)
        w.freed.add(a.id, 7, SLOT)
        w.freed.flush(space_short=w.queue.space_short)
        assert w.events[a.id] == []  # lingering
        waiting = asyncio.ensure_future(w.queue.grant(b, 8 * SLOT, 0.05, arena.name))
        await asyncio.sleep(0)
        assert w.queue.space_short
        assert w.events[a.id] == [Freed((7,)), Reclaim()]
        assert w.events[reader.id] == [Reclaim()]
        assert w.events[b.id] == []  # the waiter is not asked to give back
        with pytest.raises(ResourceExhaustedError, match="no 524288 byte run became free"):
            await waiting
        assert not w.queue.space_short

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_per_session_grants_and_waits_are_bounded(arena: Arena) -> None:
    w = World(arena, grants=2, waits=1)
    s, hog = w.session("s"), w.session("hog")

    async def scenario() -> None:
        await w.queue.grant(s, SLOT, 1.0, arena.name)
        await w.queue.grant(s, SLOT, 1.0, arena.name)
        with pytest.raises(ResourceExhaustedError, match="max-session-grants"):
            await w.queue.grant(s, SLOT, 1.0, arena.name)
        await w.queue.grant(hog, 24 * SLOT, 1.0, arena.name)
        first = asyncio.ensure_future(w.queue.grant(hog, 8 * SLOT, 5.0, arena.name))
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhaustedError, match="max-grant-waits"):
            await w.queue.grant(hog, SLOT, 5.0, arena.name)
        # A closed session's waits fail with SessionClosedError; a drain fails the rest.
        w.sessions.close(hog.id)
        w.queue.session_closed(hog)
        with pytest.raises(SessionClosedError):
            await first
        other = asyncio.ensure_future(w.queue.grant(w.session("late"), 8 * SLOT, 5.0, arena.name))
        await asyncio.sleep(0)
        w.queue.drain()
        with pytest.raises(DrainingError):
            await other
        with pytest.raises(DrainingError):
            await w.queue.grant(s, SLOT, 1.0, arena.name)

    asyncio.run(asyncio.wait_for(scenario(), 5))
