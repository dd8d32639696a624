"""A request's record cannot be grown without bound by one writer.

A writer names any ``to_stage`` in a Reserve, and may cancel the lease in the
same frame and reserve the slot again: it holds nothing, yet each Reserve used
to add its stage name to the request's record, which a record touched all the
time never lets go of.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from relayd_client import PermissionDeniedError
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.pools.arena import Arena
from relayd.pools.leases import LeaseManager
from relayd.pools.records import LeaseState
from relayd.pools.sessions import Session
from relayd.rpc.frames import frame_sink
from tests.unit._pools import SLOT, unit_arena

# Far more stages than one request passes through, far fewer than a flood names.
FLOOD = 5_000
MAX_NAMES = 64


@pytest.fixture
def arena() -> Iterator[Arena]:
    with unit_arena(32) as a:
        yield a


def _session(m: LeaseManager, stages: list[str], frames: list[pb.SessionFrame]) -> Session:
    s = m.open_session(pid=1, stages=stages)
    return m.bind(s.id, s.token, frame_sink(frames.append), pid=1, uid=0, gid=0)


def test_reserve_and_cancel_naming_new_stages_does_not_grow_the_request_record(
    arena: Arena,
) -> None:
    m = LeaseManager(
        arena, grant_bytes=8 * SLOT, lease_ttl=10.0, stage_quota_bytes=24 * SLOT, max_sessions=8
    )
    frames: list[pb.SessionFrame] = []
    w = _session(m, ["thinker"], frames)
    grant = asyncio.run(m.grant(w, SLOT, 1.0))
    base = m.new_generation_base(grant)
    for n in range(1, FLOOD + 1):
        lid = base + n
        m.on_reserve(w, pb.Reserve(lease_id=lid, grant_id=grant.id, slot=grant.run.slot,
                                   nslots=1, generation=lid, request_id="r",
                                   to_stage=f"s{n:0>200}", from_stage="thinker"))  # fmt: skip
        m.on_cancel(w, pb.Cancel(lease_id=lid))
    assert not m.leases and grant.last_lease == base + FLOOD
    req = m.requests["r"]
    assert req.leases is None
    assert len(req.readers) == MAX_NAMES and len(req.writers) == 1


def test_the_stages_of_a_request_are_still_its_own_to_abort(arena: Arena) -> None:
    m = LeaseManager(
        arena, grant_bytes=8 * SLOT, lease_ttl=10.0, stage_quota_bytes=24 * SLOT, max_sessions=8
    )
    frames: list[pb.SessionFrame] = []
    w = _session(m, ["thinker"], frames)
    r = _session(m, ["talker"], frames)
    other = _session(m, ["critic"], frames)
    grant = asyncio.run(m.grant(w, SLOT, 1.0))
    lid = m.new_generation_base(grant) + 1
    m.on_reserve(w, pb.Reserve(lease_id=lid, grant_id=grant.id, slot=grant.run.slot, nslots=1,
                               generation=lid, request_id="r", to_stage="talker",
                               from_stage="thinker"))  # fmt: skip
    m.on_publish(w, pb.Publish(lease_id=lid, nbytes=SLOT, transport=pb.TRANSPORT_SHM))
    assert m.leases[lid].state is LeaseState.PUBLISHED
    with pytest.raises(PermissionDeniedError):
        m.abort(other, "r")
    assert m.abort(r, "r") == (1, SLOT)
    assert not m.leases
