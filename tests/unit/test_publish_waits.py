"""A read through the daemon (the socket fallback's GetBytes) that comes before its
lease's lingering Publish: it waits for the Publish while one can still come, and
only then, for a bounded time, and in bounded number."""

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


@pytest.fixture
def arena() -> Iterator[Arena]:
    with unit_arena(32) as a:
        yield a


def _manager(arena: Arena) -> LeaseManager:
    return LeaseManager(
        arena, grant_bytes=8 * SLOT, lease_ttl=60.0, stage_quota_bytes=24 * SLOT, max_sessions=8
    )


def _session(m: LeaseManager, stage: str) -> Session:
    s = m.open_session(pid=1, stages=[stage])
    return m.bind(s.id, s.token, frame_sink(lambda frame: None), pid=1, uid=0, gid=0)


class Writer:
    """A writer's grant and its notices, written into the arena as a client would."""

    def __init__(self, m: LeaseManager, arena: Arena) -> None:
        self.m, self.arena = m, arena
        self.session = _session(m, "thinker")
        self.grant = asyncio.run(m.grant(self.session, 2 * SLOT, BOUND))
        self.lease_id = m.new_generation_base(self.grant) + 1

    def write(self, data: bytes) -> None:
        run = self.grant.run
        seg = self.arena.segments[run.segment]
        start = seg.slot_offset(run.slot)
        seg.mm[start : start + len(data)] = data
        seg.write_header(run.slot, self.lease_id, len(data))

    def reserve(self) -> None:
        self.m.on_reserve(self.session, pb.Reserve(
            lease_id=self.lease_id, grant_id=self.grant.id, slot=self.grant.run.slot, nslots=1,
            generation=self.lease_id, request_id="r", to_stage="talker", from_stage="thinker",
        ))  # fmt: skip

    def publish(self, nbytes: int) -> None:
        self.m.on_publish(
            self.session,
            pb.Publish(lease_id=self.lease_id, nbytes=nbytes, transport=pb.TRANSPORT_SOCKET),
        )


Parts = tuple[LeaseManager, "Writer", Session]


@pytest.fixture
def parts(arena: Arena) -> Parts:
    """A lease table, a writer holding a grant in it, and a reader of its stage."""
    m = _manager(arena)
    return m, Writer(m, arena), _session(m, "talker")


def _read(m: LeaseManager, reader: Session, lease_id: int) -> asyncio.Task[bytes]:
    return asyncio.ensure_future(m.read_out(reader, lease_id, lease_id, "r"))


async def _until_waiting(m: LeaseManager, n: int) -> None:
    await async_wait_until(lambda: m.table.publish_waits.waiting == n, BOUND, f"{n} waiting reads")


async def _stale(m: LeaseManager, reader: Session, lease_id: int, generation: int) -> None:
    """The read ends in StaleRefError, well within the test's bound."""
    with pytest.raises(StaleRefError):
        await asyncio.wait_for(m.read_out(reader, lease_id, generation, "r"), BOUND)


@pytest.mark.parametrize("announced", ["reserved", "not yet reserved"])
def test_a_read_waits_for_its_lingering_publish(
    parts: Parts, monkeypatch: pytest.MonkeyPatch, announced: str
) -> None:
    monkeypatch.setattr(publish_waits, "PUBLISH_WAIT_S", 3600.0)  # only the Publish wakes it
    m, w, reader = parts
    data = os.urandom(1000)
    w.write(data)
    if announced == "reserved":
        w.reserve()

    async def scenario() -> bytes:
        read = _read(m, reader, w.lease_id)
        await _until_waiting(m, 1)
        assert not read.done()
        if announced != "reserved":
            w.reserve()
        w.publish(len(data))
        return await asyncio.wait_for(read, BOUND)

    assert asyncio.run(scenario()) == data
    assert m.table.publish_waits.waiting == 0
    assert not m.leases  # read out and freed, as its reader would


def test_a_read_that_no_publish_can_answer_is_stale_at_once(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publish_waits, "PUBLISH_WAIT_S", 3600.0)
    m, w, reader = parts
    w.write(b"x" * 100)
    w.reserve()
    w.publish(100)
    gone = w.lease_id
    assert asyncio.run(m.read_out(reader, gone, gone, "r")) == b"x" * 100

    asyncio.run(_stale(m, reader, gone, gone))  # read already: ids up to the last are gone
    no_grant = gone + (7 << 32)
    asyncio.run(_stale(m, reader, no_grant, no_grant))
    w.lease_id += 1
    w.reserve()
    asyncio.run(_stale(m, reader, w.lease_id, w.lease_id + 1))  # reserved, another generation
    m.close_session(w.session.id)
    asyncio.run(_stale(m, reader, w.lease_id + 1, w.lease_id + 1))  # its writer is gone
    assert m.table.publish_waits.waiting == 0


def test_an_unpublished_read_gives_up_at_the_bound_and_leaves_nothing_waiting(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publish_waits, "PUBLISH_WAIT_S", 0.05)
    m, w, reader = parts
    w.reserve()  # and never published
    asyncio.run(_stale(m, reader, w.lease_id, w.lease_id))
    assert m.table.publish_waits.waiting == 0


def test_waiting_reads_are_capped_and_a_cancelled_one_leaves_nothing(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publish_waits, "MAX_WAITING", 2)
    m, w, reader = parts
    w.reserve()

    async def scenario() -> None:
        first, second = _read(m, reader, w.lease_id), _read(m, reader, w.lease_id)
        await _until_waiting(m, 2)
        await _stale(m, reader, w.lease_id, w.lease_id)  # the third is answered at once
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert m.table.publish_waits.waiting == 1
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        assert m.table.publish_waits.waiting == 0

    asyncio.run(scenario())
