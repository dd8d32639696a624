"""A Reserve that takes a cancel first still may not lie over a lease a push reads.

A lease freed while its push reads it (abort, TTL, a reader) leaves the table
at once but keeps its slots until the push stops (``LeaseTable.hold``). A
writer's Reserve over slots of a lease it cancels in the same frame took that
cancel first and was then accepted without looking at the rest of its slots:
over such a held lease too. When the push stopped, giving the held slots back
cleared the new lease's marks, and a third lease could be reserved over it.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator

import pytest
from relayd_client import InvalidArgumentError
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


def _reserve(grant: Grant, lease_id: int, first: int, nslots: int, rid: str) -> pb.Reserve:
    return pb.Reserve(lease_id=lease_id, grant_id=grant.id, slot=grant.run.slot + first,
                      nslots=nslots, generation=lease_id, request_id=rid, to_stage="talker",
                      from_stage="thinker")  # fmt: skip


def test_a_reserve_taking_a_cancel_first_cannot_cover_a_held_lease(arena: Arena) -> None:
    m = LeaseManager(
        arena, grant_bytes=8 * SLOT, lease_ttl=10.0, stage_quota_bytes=24 * SLOT, max_sessions=8
    )
    frames: list[pb.SessionFrame] = []
    s = m.open_session(pid=1, stages=["thinker"])
    w: Session = m.bind(s.id, s.token, frame_sink(frames.append), pid=1, uid=0, gid=0)
    grant = asyncio.run(m.grant(w, SLOT, 1.0))
    base = m.new_generation_base(grant)
    pushed, cancelled, over = base + 1, base + 2, base + 3
    m.on_reserve(w, _reserve(grant, pushed, 0, 2, "p"))
    m.on_publish(w, pb.Publish(lease_id=pushed, nbytes=2 * SLOT, transport=pb.TRANSPORT_SHM))
    lease = m.leases[pushed]
    m.hold(lease)  # a push reads it
    assert m.abort(w, "p") == (1, 2 * SLOT)  # freed meanwhile: its slots wait for the push
    assert pushed not in m.leases and m.table.held_in(grant) == [lease]
    m.on_reserve(w, _reserve(grant, cancelled, 2, 1, "q"))
    assert m.leases[cancelled].state is LeaseState.RESERVED
    with pytest.raises(InvalidArgumentError, match="overlap"):
        m.on_reserve(w, _reserve(grant, over, 0, 3, "q"), {cancelled})
    assert over not in m.leases
    m.unhold(lease)
    assert m.table.held_in(grant) == []
    # Now free: the slots are the writer's again.
    m.on_reserve(w, _reserve(grant, over + 1, 0, 2, "q"))
    with pytest.raises(InvalidArgumentError, match="overlap"):
        m.on_reserve(w, _reserve(grant, over + 2, 1, 1, "q"))


def _lines_run_by_reserves_over_cancels(arena: Arena, others: int) -> int:
    """Python lines run by 50 Reserves, each over the lease the frame cancels
    before it, in a grant that also holds ``others`` live one-slot leases."""
    m = LeaseManager(
        arena, grant_bytes=SLOT, lease_ttl=10.0, stage_quota_bytes=(others + 1) * SLOT,
        max_sessions=8,
    )  # fmt: skip
    frames: list[pb.SessionFrame] = []
    s = m.open_session(pid=1, stages=["thinker"])
    w = m.bind(s.id, s.token, frame_sink(frames.append), pid=1, uid=0, gid=0)
    grant = asyncio.run(m.grant(w, (others + 1) * SLOT, 1.0))
    base = m.new_generation_base(grant)
    for n in range(1, others + 1):
        m.on_reserve(w, _reserve(grant, base + n, n, 1, "q"))
    first = base + others + 1
    m.on_reserve(w, _reserve(grant, first, 0, 1, "q"))
    ids = range(first + 1, first + 51)
    reserves = [_reserve(grant, lid, 0, 1, "q") for lid in ids]
    cancelled = {first, *ids}
    lines = 0

    def tracer(frame: object, event: str, arg: object) -> object:
        nonlocal lines
        if event == "line":
            lines += 1
        return tracer

    sys.settrace(tracer)
    try:
        for r in reserves:
            m.on_reserve(w, r, cancelled)
    finally:
        sys.settrace(None)
    assert len(m.leases) == others + 1 and grant.last_lease == first + 50
    return lines


def test_a_reserve_over_a_cancelled_lease_does_not_look_at_every_lease_of_its_grant() -> None:
    # A grant may hold as many leases as slots (tens of thousands), and a 4 MiB
    # frame carries about as many Reserves: work per Reserve must not grow
    # with the grant, or one frame holds the daemon's loop for minutes.
    with unit_arena(1024 + 8) as big_arena:
        big = _lines_run_by_reserves_over_cancels(big_arena, 1023)
    with unit_arena(32) as small_arena:
        small = _lines_run_by_reserves_over_cancels(small_arena, 15)
    assert big == small
