"""The limits that bound one client, on the LeaseManager directly (a real, small arena)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from relayd_client import PermissionDeniedError, ResourceExhaustedError
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.pools import requests as requests_mod
from relayd.pools.arena import Arena
from relayd.pools.leases import LeaseManager
from relayd.pools.sessions import Session
from relayd.rpc.frames import frame_sink
from tests.unit._pools import SLOT, unit_arena


@pytest.fixture
def arena() -> Iterator[Arena]:
    with unit_arena(64) as a:
        yield a


def _manager(arena: Arena, **kw: int) -> LeaseManager:
    return LeaseManager(arena, grant_bytes=4 * SLOT, lease_ttl=10.0,
                        stage_quota_bytes=kw.pop("quota", 16 * SLOT), max_sessions=16, **kw)  # fmt: skip


def _session(m: LeaseManager, stage: str, frames: list[pb.SessionFrame]) -> Session:
    s = m.open_session(pid=1, stages=[stage])
    return m.bind(s.id, s.token, frame_sink(frames.append), pid=1, uid=0, gid=0)


def _errors(frames: list[pb.SessionFrame]) -> list[pb.Event]:
    return [ev for f in frames for ev in f.event if ev.kind == pb.EVENT_KIND_ERROR]


def test_stage_quota_is_shared_by_all_sessions_of_the_stage(arena: Arena) -> None:
    m = _manager(arena)
    a, b = _session(m, "thinker", []), _session(m, "thinker", [])
    other = _session(m, "encoder", [])
    asyncio.run(m.grant(a, 10 * SLOT, 1.0))
    # A second session of the same stage gets only what is left of the stage's quota.
    with pytest.raises(ResourceExhaustedError):
        asyncio.run(m.grant(b, 8 * SLOT, 0.05))
    asyncio.run(m.grant(b, 6 * SLOT, 0.05))
    # Another stage is not affected.
    asyncio.run(m.grant(other, 16 * SLOT, 0.05))


def test_default_grants_shrink_to_what_the_stage_quota_leaves(arena: Arena) -> None:
    # --grant-size above --max-stage-bytes: a default-size grant could never
    # fit, and every put waited for its deadline.
    m = LeaseManager(arena, grant_bytes=8 * SLOT, lease_ttl=10.0, stage_quota_bytes=5 * SLOT,
                     max_sessions=16)  # fmt: skip
    a, b = _session(m, "thinker", []), _session(m, "thinker", [])

    async def scenario() -> None:
        first = await m.grant(a, SLOT, 0.05)
        assert first.run.nslots == 5  # the whole quota, not the default 8
        with pytest.raises(ResourceExhaustedError):
            await m.grant(b, SLOT, 0.05)  # the stage has nothing left: it waits
        m.return_grant(a, first.id)
        second = await m.grant(b, 2 * SLOT, 0.05)
        assert second.run.nslots == 5
        m.return_grant(b, second.id)
        # Another stage's grant leaves this one's room alone.
        await m.grant(_session(m, "talker", []), SLOT, 0.05)
        assert (await m.grant(a, 3 * SLOT, 0.05)).run.nslots == 5

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_grants_per_session_and_waiting_grant_calls_are_bounded(arena: Arena) -> None:
    m = _manager(arena, max_session_grants=2, max_grant_waits=1)
    s = _session(m, "thinker", [])
    asyncio.run(m.grant(s, SLOT, 1.0))
    asyncio.run(m.grant(s, SLOT, 1.0))
    with pytest.raises(ResourceExhaustedError, match="max-session-grants"):
        asyncio.run(m.grant(s, SLOT, 1.0))

    hog = _session(m, "hog", [])

    async def scenario() -> None:
        await m.grant(hog, 16 * SLOT, 1.0)  # the hog's whole quota
        first = asyncio.ensure_future(m.grant(hog, SLOT, 0.5))
        await asyncio.sleep(0)  # let it queue
        with pytest.raises(ResourceExhaustedError, match="max-grant-waits"):
            await m.grant(hog, SLOT, 0.5)
        with pytest.raises(ResourceExhaustedError):
            await first

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_a_writer_cannot_name_another_stage_as_its_own(arena: Arena) -> None:
    m = _manager(arena)
    frames: list[pb.SessionFrame] = []
    s = _session(m, "intruder", frames)
    g = asyncio.run(m.grant(s, SLOT, 1.0))
    lid = m.new_generation_base(g) + 1
    with pytest.raises(PermissionDeniedError, match="from_stage"):  # the session is closed
        m.on_reserve(s, pb.Reserve(lease_id=lid, grant_id=g.id, slot=g.run.slot, nslots=1,
                                   generation=lid, request_id="r", to_stage="talker",
                                   from_stage="thinker"))  # fmt: skip
    assert lid not in m.leases


def test_pre_abort_by_an_uninvolved_stage_binds_nothing(arena: Arena) -> None:
    m = _manager(arena)
    wf: list[pb.SessionFrame] = []
    w, bystander = _session(m, "thinker", wf), _session(m, "bystander", [])
    m.abort(bystander, "future")
    assert not [f for f in wf if f.aborted], "an uninvolved stage was told of the abort"
    g = asyncio.run(m.grant(w, SLOT, 1.0))
    lid = m.new_generation_base(g) + 1
    m.on_reserve(w, pb.Reserve(lease_id=lid, grant_id=g.id, slot=g.run.slot, nslots=1,
                               generation=lid, request_id="future", to_stage="talker",
                               from_stage="thinker"))  # fmt: skip
    m.on_publish(w, pb.Publish(lease_id=lid, nbytes=SLOT, transport=pb.TRANSPORT_SHM))
    assert lid in m.leases  # published, not freed by the bystander's tombstone
    # The reader's own pre-abort still binds.
    reader = _session(m, "talker", [])
    m.abort(reader, "later")
    lid2 = lid + 1
    m.on_reserve(w, pb.Reserve(lease_id=lid2, grant_id=g.id, slot=g.run.slot + 1, nslots=1,
                               generation=lid2, request_id="later", to_stage="talker",
                               from_stage="thinker"))  # fmt: skip
    m.on_publish(w, pb.Publish(lease_id=lid2, nbytes=SLOT, transport=pb.TRANSPORT_SHM))
    assert lid2 not in m.leases


def test_abort_tombstones_are_capped(arena: Arena, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(requests_mod, "MAX_TOMBSTONES", 64)
    m = _manager(arena)
    s = _session(m, "flooder", [])
    for i in range(1000):
        m.abort(s, f"r{i}")
    assert len(m.requests) <= 64
