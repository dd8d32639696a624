"""A session that closes while its grant call waits is reclaimed whole, and only once.

Closing a session frees the leases it had claimed; one of a dead writer's grant
gives its run back to the pool, which serves the grant waiters, the closing
session's own wait among them. That wait must fail, not be served: the session
is closed, and serving it used to raise out of the reclaim halfway, leaving the
session's grants held forever.

A wait served just before its session closes gets a grant the close orphans
and gives back at once; the call, resuming later, must not use that run (it
may be another session's grant by then) nor free it again.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator

import pytest
from relayd_client import SessionClosedError
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.pools.arena import Arena
from relayd.pools.leases import LeaseManager
from relayd.pools.records import Grant, LeaseState, ReclaimReason
from relayd.pools.sessions import Session
from relayd.rpc.frames import frame_sink
from tests.unit._pools import SLOT, unit_arena


@pytest.fixture
def arena() -> Iterator[Arena]:
    with unit_arena(32) as a:
        yield a


def _session(m: LeaseManager, stage: str) -> Session:
    frames: list[pb.SessionFrame] = []
    s = m.open_session(pid=1, stages=[stage])
    return m.bind(s.id, s.token, frame_sink(frames.append), pid=1, uid=0, gid=0)


def _publish(m: LeaseManager, w: Session, grant: Grant, first: int, nslots: int) -> int:
    lid = max(m.new_generation_base(grant), grant.last_lease) + 1
    m.on_reserve(w, pb.Reserve(lease_id=lid, grant_id=grant.id, slot=grant.run.slot + first,
                               nslots=nslots, generation=lid, request_id="r",
                               to_stage="talker", from_stage=w.stages[0]))  # fmt: skip
    m.on_publish(w, pb.Publish(lease_id=lid, nbytes=SLOT, transport=pb.TRANSPORT_SHM))
    return lid


def test_a_reader_closed_while_its_grant_waits_gives_back_its_claims_and_grants(
    arena: Arena,
) -> None:
    reclaimed: list[str] = []

    async def scenario() -> None:
        m = LeaseManager(
            arena, grant_bytes=8 * SLOT, lease_ttl=10.0, stage_quota_bytes=24 * SLOT,
            max_sessions=8,
        )  # fmt: skip
        m.hooks.reclaimed = lambda reason, n: reclaimed.extend([reason.value] * n)
        w, r, other = _session(m, "thinker"), _session(m, "talker"), _session(m, "critic")
        grant = await m.grant(w, 8 * SLOT, 1.0)
        lid, later = _publish(m, w, grant, 0, 4), _publish(m, w, grant, 4, 4)
        m.close_session(w.id)  # the writer went: its grant is an orphan, the leases stay
        mine = await m.grant(r, 8 * SLOT, 1.0)  # the reader writes too
        for _ in range(2):
            await m.grant(other, 8 * SLOT, 1.0)
        assert arena.free_slots == 0
        m.on_claim(r, pb.Claim(lease_id=lid, generation=lid))
        assert m.leases[lid].state is LeaseState.CLAIMED
        wait = asyncio.ensure_future(m.grant(r, 4 * SLOT, 30.0))
        await asyncio.sleep(0)  # the call is in the queue, waiting for space
        assert not wait.done()
        m.close_session(r.id)
        with pytest.raises(SessionClosedError):
            await asyncio.wait_for(wait, 5)
        assert reclaimed == [ReclaimReason.READER_DIED.value]
        assert list(m.leases) == [later]
        assert mine.id not in m.grants and r.grants == {}
        # Another reader of the stage reads the other lease: its Release frees
        # a run of the orphan, which serves waiters, and must not fail its frame.
        m.on_release(_session(m, "talker"), pb.Release(lease_id=later, generation=later))
        assert not m.leases
        # Only the third session's two grants are still out.
        assert sorted(g.session_id for g in m.grants.values()) == [other.id, other.id]
        assert arena.free_slots == arena.capacity_slots - 16

    asyncio.run(asyncio.wait_for(scenario(), 10))


async def _served_as_it_closes(arena: Arena, cancel: bool) -> BaseException | None:
    """r's wait for space is served, and in the same turn r's connection ends; the
    close orphans the grant, whose run goes back and serves x's wait. r waits in
    a Grant call or, with ``cancel``, in a pull's reservation, whose fetch task
    the connection's end cancels. What r's call ended with; x's run must be x's
    alone."""
    m = LeaseManager(
        arena, grant_bytes=8 * SLOT, lease_ttl=10.0, stage_quota_bytes=24 * SLOT, max_sessions=8
    )
    full, last = _session(m, "thinker"), _session(m, "other")
    for _ in range(3):
        await m.grant(full, 8 * SLOT, 1.0)
    back = await m.grant(last, 8 * SLOT, 1.0)
    assert arena.free_slots == 0
    r, x = _session(m, "talker"), _session(m, "critic")
    if cancel:
        pull = m.crossnode.reserve_for_pull(
            r, 8 * SLOT, 30.0, request_id="q", from_stage="remote", to_stage="talker"
        )
        call: asyncio.Future[object] = asyncio.ensure_future(pull)
    else:
        call = asyncio.ensure_future(m.grant(r, 8 * SLOT, 30.0))
    await asyncio.sleep(0)
    waits = asyncio.ensure_future(m.grant(x, 8 * SLOT, 30.0))
    await asyncio.sleep(0)
    assert not call.done() and not waits.done()
    m.return_grant(last, back.id)  # serves r's wait
    assert len(r.grants) == 1
    if cancel:
        call.cancel()
    m.close_session(r.id)
    got = await asyncio.wait_for(waits, 5)
    assert got.run == back.run and m.grants[got.id] is got
    outcome = (await asyncio.wait_for(asyncio.gather(call, return_exceptions=True), 5))[0]
    # Every slot is held by exactly one live grant: none is free to hand out twice.
    assert arena.free_slots == 0 and arena.allocate(1) is None
    assert sum(g.run.nslots for g in m.grants.values()) == arena.capacity_slots
    assert not m.leases  # no pull lease over x's run
    return outcome if isinstance(outcome, BaseException) else None


def test_a_grant_served_as_its_session_closes_is_not_handed_to_the_closed_session(
    arena: Arena,
) -> None:
    outcome = asyncio.run(asyncio.wait_for(_served_as_it_closes(arena, cancel=False), 10))
    assert type(outcome) is SessionClosedError


def test_a_grant_served_as_its_session_closes_and_its_call_is_cancelled_is_freed_once(
    arena: Arena,
) -> None:
    outcome = asyncio.run(asyncio.wait_for(_served_as_it_closes(arena, cancel=True), 10))
    # Before 3.12, wait_for answers a cancel that comes with the result by returning it.
    expected = asyncio.CancelledError if sys.version_info >= (3, 12) else SessionClosedError
    assert type(outcome) is expected
