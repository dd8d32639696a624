"""One uid cannot take every place among the reads waiting for their Publish.

Any session may name the ids of any live grant not announced yet, and one uid
may hold half the daemon's sessions. Reads of such ids from one uid's sessions
take at most that uid's share of the places; an honest reader of another uid
whose read overtakes its lease's Publish still waits for it and reads the
bytes, rather than being told the lease is stale.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest
from relayd_client import StaleRefError
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.pools import publish_waits
from relayd.pools.arena import Arena
from relayd.pools.leases import LeaseManager
from relayd.pools.sessions import Session
from relayd.rpc.frames import frame_sink
from tests._daemon import async_wait_until
from tests.unit._pools import SLOT, unit_arena

BOUND = 10.0  # no test waits this long unless the behaviour under test is broken
PLACES = 8  # reads waiting at once, over all uids (scaled down for the test)
SHARE = 2  # ... and from the sessions of one uid
FLOODER_UID, READER_UID = 1000, 1001


@pytest.fixture
def arena() -> Iterator[Arena]:
    with unit_arena(32) as a:
        yield a


def _session(m: LeaseManager, stage: str, uid: int) -> Session:
    s = m.open_session(pid=1, stages=[stage])
    return m.bind(s.id, s.token, frame_sink(lambda frame: None), pid=1, uid=uid, gid=uid)


def test_one_uid_cannot_crowd_out_another_uids_read_waiting_for_its_publish(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publish_waits, "PUBLISH_WAIT_S", 3600.0)  # only a Publish wakes a read
    monkeypatch.setattr(publish_waits, "MAX_WAITING", PLACES)
    monkeypatch.setattr(publish_waits, "MAX_WAITING_PER_UID", SHARE, raising=False)
    m = LeaseManager(
        arena, grant_bytes=8 * SLOT, lease_ttl=60.0, stage_quota_bytes=24 * SLOT, max_sessions=8
    )
    writer = _session(m, "thinker", uid=0)
    flooders = [_session(m, "critic", FLOODER_UID) for _ in range(2)]
    reader = _session(m, "talker", READER_UID)
    data = os.urandom(1000)

    async def scenario() -> None:
        grant = await m.grant(writer, 2 * SLOT, BOUND)
        lease_id = m.new_generation_base(grant) + 1
        run = grant.run
        seg = arena.segments[run.segment]
        start = seg.slot_offset(run.slot)
        seg.mm[start : start + len(data)] = data
        seg.write_header(run.slot, lease_id, len(data))

        # The flooding uid names ids of the writer's grant nobody announced, as
        # many reads as there are places in all.
        flood = [
            asyncio.ensure_future(
                m.read_out(flooders[i % 2], lease_id + 1 + i, lease_id + 1 + i, "r")
            )
            for i in range(PLACES)
        ]
        waits = m.table.publish_waits
        await async_wait_until(
            lambda: waits.waiting + sum(f.done() for f in flood) == PLACES, BOUND, "the flood"
        )
        assert waits.waiting == SHARE  # the rest were answered at once
        beyond = [f for f in flood if f.done()]
        assert len(beyond) == PLACES - SHARE
        assert all(isinstance(f.exception(), StaleRefError) for f in beyond)

        # The honest read overtakes its Publish: it waits for it, and reads the bytes.
        read = asyncio.ensure_future(m.read_out(reader, lease_id, lease_id, "r"))
        await async_wait_until(
            lambda: read.done() or waits.waiting == SHARE + 1, BOUND, "the read to wait"
        )
        assert not read.done()
        m.on_reserve(writer, pb.Reserve(
            lease_id=lease_id, grant_id=grant.id, slot=run.slot, nslots=1, generation=lease_id,
            request_id="r", to_stage="talker", from_stage="thinker",
        ))  # fmt: skip
        m.on_publish(
            writer, pb.Publish(lease_id=lease_id, nbytes=len(data), transport=pb.TRANSPORT_SOCKET)
        )
        assert await asyncio.wait_for(read, BOUND) == data

        for f in flood:
            f.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        assert waits.waiting == 0
        assert waits.from_uid(FLOODER_UID) == 0 and waits.from_uid(READER_UID) == 0

    asyncio.run(asyncio.wait_for(scenario(), 2 * BOUND))
