"""A cancel must not touch the slot header of the lease the writer already put in its place.

The client frees a cancelled lease's slots at once and cuts the next lease
from them (LIFO), stamping that lease's header when its bytes are in; the
Cancel itself only lingers in the pending frame. So when the daemon hears the
Cancel, the first slot's header may already belong to the next lease.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.pools.arena import Arena
from relayd.pools.leases import LeaseManager
from relayd.pools.records import Grant, LeaseState
from relayd.pools.sessions import Session
from relayd.rpc.frames import frame_sink
from tests.unit._pools import SLOT, unit_arena


@pytest.fixture
def arena() -> Iterator[Arena]:
    with unit_arena(32) as a:
        yield a


def _setup(
    arena: Arena, wf: list[pb.SessionFrame], rf: list[pb.SessionFrame]
) -> tuple[LeaseManager, Session, Session, Grant]:
    m = LeaseManager(
        arena, grant_bytes=8 * SLOT, lease_ttl=10.0, stage_quota_bytes=24 * SLOT, max_sessions=8
    )
    sessions = []
    for stage, frames in (("thinker", wf), ("talker", rf)):
        s = m.open_session(pid=1, stages=[stage])
        sessions.append(m.bind(s.id, s.token, frame_sink(frames.append), pid=1, uid=0, gid=0))
    w, r = sessions
    grant = asyncio.run(m.grant(w, SLOT, 1.0))
    return m, w, r, grant


def _reserve(grant: Grant, lease_id: int, nslots: int) -> pb.Reserve:
    return pb.Reserve(lease_id=lease_id, grant_id=grant.id, slot=grant.run.slot, nslots=nslots,
                      generation=lease_id, request_id="r", to_stage="talker",
                      from_stage="thinker")  # fmt: skip


def _read(m: LeaseManager, r: Session, lease_id: int) -> None:
    m.on_claim(r, pb.Claim(lease_id=lease_id, generation=lease_id))
    m.on_release(r, pb.Release(lease_id=lease_id, generation=lease_id))
    m.flush()


def test_a_cancel_in_the_frame_of_the_next_lease_keeps_that_lease_readable(arena: Arena) -> None:
    wf: list[pb.SessionFrame] = []
    rf: list[pb.SessionFrame] = []
    m, w, r, grant = _setup(arena, wf, rf)
    seg, slot = grant.run.segment, grant.run.slot
    a = m.new_generation_base(grant) + 1
    m.on_reserve(w, _reserve(grant, a, 2))  # an earlier frame
    # The writer cancels ``a``, cuts ``b`` from the same slots and seals it;
    # the Cancel and ``b``'s Reserve (carrying its Publish) share one frame.
    b = a + 1
    arena.segments[seg].write_header(slot, b, SLOT)
    reserve = _reserve(grant, b, 1)
    reserve.publish.CopyFrom(pb.Publish(lease_id=b, nbytes=SLOT, transport=pb.TRANSPORT_SHM))
    lease = m.on_reserve(w, reserve, {a})
    m.on_sealed(w, lease, reserve.publish)
    m.on_cancel(w, pb.Cancel(lease_id=a))
    assert list(m.leases) == [b] and m.leases[b].state is LeaseState.PUBLISHED
    assert arena.header(seg, slot) == (b, SLOT)  # what the reader checks its DataRef against
    _read(m, r, b)
    assert not m.leases and arena.header(seg, slot) == (0, 0)
    assert [e for f in rf for e in f.event] == []


def test_a_cancel_heard_after_the_next_lease_was_sealed_keeps_that_lease_readable(
    arena: Arena,
) -> None:
    wf: list[pb.SessionFrame] = []
    rf: list[pb.SessionFrame] = []
    m, w, r, grant = _setup(arena, wf, rf)
    seg, slot = grant.run.segment, grant.run.slot
    a = m.new_generation_base(grant) + 1
    m.on_reserve(w, _reserve(grant, a, 2))
    # Sealed by the writer before the daemon handles the frame with the Cancel.
    b = a + 1
    arena.segments[seg].write_header(slot, b, SLOT)
    m.on_cancel(w, pb.Cancel(lease_id=a))
    assert not m.leases
    assert arena.header(seg, slot) == (b, SLOT)
    m.on_reserve(w, _reserve(grant, b, 1))
    m.on_publish(w, pb.Publish(lease_id=b, nbytes=SLOT, transport=pb.TRANSPORT_SHM))
    assert arena.header(seg, slot) == (b, SLOT)
    _read(m, r, b)
    assert not m.leases and arena.header(seg, slot) == (0, 0)


def test_a_writer_that_dies_after_a_cancel_still_has_its_next_sealed_lease_adopted(
    arena: Arena,
) -> None:
    # The Reserve of the next lease never came: its header is all the daemon has.
    wf: list[pb.SessionFrame] = []
    rf: list[pb.SessionFrame] = []
    m, w, r, grant = _setup(arena, wf, rf)
    seg, slot = grant.run.segment, grant.run.slot
    a = m.new_generation_base(grant) + 1
    m.on_reserve(w, _reserve(grant, a, 2))
    b = a + 1
    arena.segments[seg].write_header(slot, b, SLOT)
    m.on_cancel(w, pb.Cancel(lease_id=a))
    m.close_session(w.id)
    assert list(m.leases) == [b] and m.leases[b].adopted
    _read(m, r, b)
    assert not m.leases and not m.grants
    assert arena.free_slots == arena.capacity_slots
