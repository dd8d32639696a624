"""A writer's Reserve over its own lease that the reader marked read.

A reader marks a lease read in its slot header, ``(0, lease id)``, before its
Release; the writer cuts its next lease from that run at once, and the
daemon may see that Reserve before the Release (a ring it takes later). It
frees the old lease then, but only a published lease of that writer whose
header no longer names it, and not one whose slots a push reads. The Release
that comes after finds nothing and parks nothing, and freeing a lease never
zeroes a header that names another.
"""

from __future__ import annotations

import asyncio
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


class _Pair:
    """A writer and a reader session on one manager, and the writer's grant."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.m = LeaseManager(
            arena, grant_bytes=8 * SLOT, lease_ttl=10.0, stage_quota_bytes=24 * SLOT,
            max_sessions=8,
        )  # fmt: skip
        self.wf: list[pb.SessionFrame] = []
        self.rf: list[pb.SessionFrame] = []
        self.w = self._session("thinker", self.wf)
        self.r = self._session("talker", self.rf)
        self.grant: Grant = asyncio.run(self.m.grant(self.w, SLOT, 1.0))
        self.next_id = self.m.new_generation_base(self.grant)

    def _session(self, stage: str, frames: list[pb.SessionFrame]) -> Session:
        s = self.m.open_session(pid=1, stages=[stage])
        return self.m.bind(s.id, s.token, frame_sink(frames.append), pid=1, uid=0, gid=0)

    def reserve(self, slot: int, nslots: int, *, sealed: bool = True) -> int:
        """A lease at ``slot`` as a writer cuts it; with ``sealed``, its header
        stamped and its Publish carried in the Reserve, as the client sends it."""
        self.next_id += 1
        lid = self.next_id
        g = self.grant
        if sealed:
            self.seg.write_header(g.run.slot + slot, lid, nslots * SLOT)
        r = pb.Reserve(lease_id=lid, grant_id=g.id, slot=g.run.slot + slot, nslots=nslots,
                       generation=lid, request_id="r", to_stage="talker",
                       from_stage="thinker")  # fmt: skip
        lease = self.m.on_reserve(self.w, r)
        if sealed:
            p = pb.Publish(lease_id=lid, nbytes=nslots * SLOT, transport=pb.TRANSPORT_SHM)
            self.m.on_sealed(self.w, lease, p)
        return lid

    @property
    def seg(self):  # type: ignore[no-untyped-def]
        return self.arena.segments[self.grant.run.segment]

    def header(self, slot: int) -> tuple[int, int]:
        return self.arena.header(self.grant.run.segment, self.grant.run.slot + slot)

    def mark_read(self, slot: int, lid: int) -> None:
        self.seg.mark_read(self.grant.run.slot + slot, lid)

    def freed(self) -> list[int]:
        self.m.flush()
        return [i for f in self.wf if f.HasField("freed") for i in f.freed.lease_ids]

    def errors(self, frames: list[pb.SessionFrame]) -> list[str]:
        return [e.message for f in frames for e in f.event]


def test_a_reserve_over_a_lease_its_reader_marked_read_frees_it(arena: Arena) -> None:
    t = _Pair(arena)
    old = t.reserve(0, 2)
    t.mark_read(0, old)
    new = t.reserve(0, 2)  # the writer saw the mark: same run, sealed already
    assert old not in t.m.leases and t.m.leases[new].state is LeaseState.PUBLISHED
    assert t.header(0) == (new, 2 * SLOT)  # the new lease's header stays
    assert t.freed() == [old]  # the writer hears it, as for a Release
    assert arena.used_bytes == 8 * SLOT  # the grant, no more
    # The reader's Release of the old lease comes later: nothing to free, nothing
    # parked for a Publish that will never come, no complaint.
    t.m.on_release(t.r, pb.Release(lease_id=old, generation=old))
    assert not t.m.table.early and t.errors(t.rf) == [] and t.errors(t.wf) == []
    assert t.m.leases[new].state is LeaseState.PUBLISHED
    t.m.on_release(t.r, pb.Release(lease_id=new, generation=new))
    assert not t.m.leases and t.header(0) == (0, 0)


@pytest.mark.parametrize(
    "case",
    [
        "unread",  # its header still names it: its reader may be copying
        "unpublished",  # its header is whatever was there before, another lease's or none
        "pushed",  # a push reads its slots; no reader on this node marks it, so forged
    ],
)
def test_a_lease_not_marked_read_or_not_free_to_take_is_an_overlap(arena: Arena, case: str) -> None:
    t = _Pair(arena)
    old = t.reserve(0, 2, sealed=case != "unpublished")
    state = t.m.leases[old].state
    if case == "pushed":
        t.m.hold(t.m.leases[old])
        t.mark_read(0, old)
    elif case == "unpublished":
        t.mark_read(0, old)
    with pytest.raises(InvalidArgumentError, match="overlap"):
        t.reserve(1, 1, sealed=False)
    assert t.m.leases[old].state is state


def test_freeing_a_lease_leaves_a_header_that_names_another(arena: Arena) -> None:
    # The Release came first this time: the writer has sealed its next lease in
    # the run already, and its Reserve is still on the way.
    t = _Pair(arena)
    old = t.reserve(0, 2)
    t.mark_read(0, old)
    t.seg.write_header(t.grant.run.slot, old + 1, SLOT)  # the next lease, sealed
    t.m.on_release(t.r, pb.Release(lease_id=old, generation=old))
    assert old not in t.m.leases and t.header(0) == (old + 1, SLOT)
    new = t.reserve(0, 1)
    assert new == old + 1 and t.m.leases[new].state is LeaseState.PUBLISHED
    # An unmarked lease freed by its Release is zeroed as before.
    other = t.reserve(4, 1)
    t.m.on_release(t.r, pb.Release(lease_id=other, generation=other))
    assert t.header(4) == (0, 0)


def test_a_release_of_a_lease_not_announced_yet_still_waits_for_it(arena: Arena) -> None:
    # Only ids at or below the grant's last Reserve are gone: a later one's
    # Reserve may still be on its way, and its early Release is kept.
    t = _Pair(arena)
    t.reserve(0, 1)
    coming = t.next_id + 1
    t.m.on_release(t.r, pb.Release(lease_id=coming, generation=coming))
    assert t.m.table.early
    assert t.reserve(1, 1) == coming
    assert coming not in t.m.leases and not t.m.table.early
