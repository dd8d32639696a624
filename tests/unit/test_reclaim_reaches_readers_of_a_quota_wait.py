"""A grant wait short of its own stage's quota still asks other stages' sessions.

The quota is summed over the stage's own sessions, so other stages' idle grants
cannot make room in it. But the writer's put waits for space in the grants its
session already holds as much as for a new grant, and a reader of another stage
may hold back Releases of leases in them (they linger on its side): the Reclaim
event makes it send them, and the Freed notices that follow let the put go on
without the grant. So the readers of the waiting stage's leases are told too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.pools.arena import Arena
from relayd.pools.events import Reclaim, SessionEvent
from relayd.pools.leases import LeaseManager
from relayd.pools.sessions import Session
from tests._daemon import async_wait_until
from tests.unit._pools import SLOT, unit_arena

BOUND = 10.0  # no test waits this long unless the behaviour under test is broken


@pytest.fixture
def arena() -> Iterator[Arena]:
    with unit_arena(32) as a:
        yield a


def _session(m: LeaseManager, stage: str, heard: dict[str, list[SessionEvent]]) -> Session:
    s = m.open_session(pid=1, stages=[stage])
    events = heard[s.id] = []
    return m.bind(s.id, s.token, events.append, pid=1, uid=0, gid=0)


def test_a_wait_on_its_stage_quota_asks_the_readers_of_its_stage_leases(arena: Arena) -> None:
    heard: dict[str, list[SessionEvent]] = {}

    async def scenario() -> None:
        m = LeaseManager(
            arena, grant_bytes=8 * SLOT, lease_ttl=10.0, stage_quota_bytes=24 * SLOT,
            max_sessions=16,
        )  # fmt: skip
        writer = _session(m, "thinker", heard)
        reader = _session(m, "talker", heard)
        grants = [await m.grant(writer, 8 * SLOT, BOUND) for _ in range(3)]
        for g in grants:  # every slot of the writer's grants holds a lease for the reader
            lid = m.new_generation_base(g) + 1
            m.on_reserve(writer, pb.Reserve(
                lease_id=lid, grant_id=g.id, slot=g.run.slot, nslots=8, generation=lid,
                request_id="r", to_stage="talker", from_stage="thinker",
            ))  # fmt: skip
            m.on_publish(writer, pb.Publish(lease_id=lid, nbytes=SLOT, transport=pb.TRANSPORT_SHM))
        assert arena.free_slots == 8  # the stage is at its quota; the pool has room
        for events in heard.values():
            events.clear()

        call = asyncio.ensure_future(m.grant(writer, 8 * SLOT, BOUND))
        await async_wait_until(
            lambda: m.queue.space_short, BOUND, "the call in the queue, waiting on the quota"
        )
        assert not call.done()
        told = {sid: sum(isinstance(e, Reclaim) for e in events) for sid, events in heard.items()}
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        assert told == {writer.id: 0, reader.id: 1}

    asyncio.run(asyncio.wait_for(scenario(), 2 * BOUND))
