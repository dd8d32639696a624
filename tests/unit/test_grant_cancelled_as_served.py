"""A Grant call cancelled in the turn its wait is served gives the grant back.

gRPC cancels the handler of a call whose client cancelled it or whose deadline
passed; a grant the handler would return then never reaches the client, which
could not give back a grant whose id it never learnt. The wait must end in
CancelledError and the run go back to the pool (here: to the next waiter),
whichever Python's ``wait_for`` is underneath.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from relayd.pools.arena import Arena
from relayd.pools.leases import LeaseManager
from relayd.pools.sessions import Session
from relayd.rpc.frames import frame_sink
from tests._daemon import async_wait_until
from tests.unit._pools import SLOT, unit_arena

BOUND = 10.0  # no test waits this long unless the behaviour under test is broken


@pytest.fixture
def arena() -> Iterator[Arena]:
    with unit_arena(32) as a:
        yield a


def _session(m: LeaseManager, stage: str) -> Session:
    s = m.open_session(pid=1, stages=[stage])
    return m.bind(s.id, s.token, frame_sink(lambda frame: None), pid=1, uid=0, gid=0)


def test_a_grant_call_cancelled_as_it_is_served_gives_the_grant_back(arena: Arena) -> None:
    async def scenario() -> None:
        m = LeaseManager(
            arena, grant_bytes=8 * SLOT, lease_ttl=10.0, stage_quota_bytes=24 * SLOT,
            max_sessions=8,
        )  # fmt: skip
        full, last = _session(m, "thinker"), _session(m, "other")
        for _ in range(3):
            await m.grant(full, 8 * SLOT, 1.0)
        back = await m.grant(last, 8 * SLOT, 1.0)
        assert arena.free_slots == 0
        r, x = _session(m, "talker"), _session(m, "critic")
        call = asyncio.ensure_future(m.grant(r, 8 * SLOT, BOUND))
        waits = asyncio.ensure_future(m.grant(x, 8 * SLOT, BOUND))
        await async_wait_until(
            lambda: len(m.queue._waiters) == 2, BOUND, "both calls in the queue, waiting for space"
        )
        assert not call.done() and not waits.done()
        m.return_grant(last, back.id)  # serves r's wait ...
        assert len(r.grants) == 1
        call.cancel()  # ... and its call ends before it resumes
        outcome = (await asyncio.wait_for(asyncio.gather(call, return_exceptions=True), BOUND))[0]
        assert type(outcome) is asyncio.CancelledError
        assert not r.grants and r.pool_slots.get(arena.name, 0) == 0
        got = await asyncio.wait_for(waits, BOUND)  # the run went on to the next waiter
        assert got.run == back.run and m.grants[got.id] is got
        assert sum(g.run.nslots for g in m.grants.values()) == arena.capacity_slots

    asyncio.run(asyncio.wait_for(scenario(), 2 * BOUND))
