"""LeaseManager rules on a real (small) arena: states, death, TTL, abort, fairness."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import Iterator

import pytest
from relayd_client import InvalidArgumentError, PermissionDeniedError, ResourceExhaustedError
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.rings import CLAIM_BIT, IdRing

from relayd.pools.arena import Arena
from relayd.pools.leases import LeaseManager
from relayd.pools.records import Hooks, LeaseState, ReclaimReason
from relayd.pools.sessions import Session
from relayd.rpc.frames import frame_sink
from tests.unit._pools import SLOT, unit_arena


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def arena() -> Iterator[Arena]:
    with unit_arena(32) as a:
        yield a


def _manager(
    arena: Arena,
    clock: Clock,
    reclaimed: list[str],
    freed_linger: float = 0.0,
    transfers: list[str] | None = None,
) -> LeaseManager:
    counted = transfers if transfers is not None else []
    return LeaseManager(
        arena, grant_bytes=8 * SLOT, lease_ttl=10.0, stage_quota_bytes=24 * SLOT,
        max_sessions=8, clock=clock, freed_linger=freed_linger,
        hooks=Hooks(reclaimed=lambda reason, n: reclaimed.extend([reason.value] * n),
                    transfer=lambda t, n, nbytes, src, dst: counted.append(t)),
    )  # fmt: skip


def _freed(frames: list[pb.SessionFrame]) -> list[list[int]]:
    """The lease ids of each Freed frame a writer got, in order."""
    return [list(f.freed.lease_ids) for f in frames if f.HasField("freed")]


def _session(m: LeaseManager, stage: str, frames: list[pb.SessionFrame]):  # type: ignore[no-untyped-def]
    s = m.open_session(pid=1, stages=[stage])
    return m.bind(s.id, s.token, frame_sink(frames.append), pid=1, uid=0, gid=0)


def _reserve(
    m, s, grant, slot: int, n: int, lease_id: int, rid: str = "r", to: str = "talker"
) -> None:  # type: ignore[no-untyped-def]
    m.on_reserve(s, pb.Reserve(lease_id=lease_id, grant_id=grant.id, slot=grant.run.slot + slot,
                               nslots=n, generation=lease_id, request_id=rid, to_stage=to,
                               from_stage=s.stages[0]))  # fmt: skip


def _publish(m, s, grant, slot: int, n: int, rid: str = "r", to: str = "talker") -> int:  # type: ignore[no-untyped-def]
    # Ids go upward within a grant and are never reused (the daemon refuses that).
    lease_id = max(m.new_generation_base(grant), grant.last_lease) + 1
    _reserve(m, s, grant, slot, n, lease_id, rid, to)
    m.on_publish(s, pb.Publish(lease_id=lease_id, nbytes=n * SLOT, transport=pb.TRANSPORT_SHM))
    return lease_id


def test_lifecycle_reserved_published_claimed_freed(arena: Arena) -> None:
    clock, reclaimed, wf, rf = Clock(), [], [], []  # type: ignore[var-annotated]
    m = _manager(arena, clock, reclaimed)
    w, r = _session(m, "thinker", wf), _session(m, "talker", rf)
    grant = asyncio.run(m.grant(w, SLOT, 1.0))
    assert grant.run.nslots == 8
    lid = _publish(m, w, grant, 0, 2)
    assert m.leases[lid].state is LeaseState.PUBLISHED
    m.on_claim(r, pb.Claim(lease_id=lid, generation=lid))
    assert m.leases[lid].state is LeaseState.CLAIMED
    m.on_release(r, pb.Release(lease_id=lid, generation=lid))
    m.flush()
    assert lid not in m.leases and reclaimed == []
    assert [f.freed.lease_ids for f in wf if f.HasField("freed")] == [[lid]]
    assert arena.header(grant.run.segment, grant.run.slot) == (0, 0)


@pytest.mark.parametrize("transport", [pb.TRANSPORT_UNSPECIFIED, 99])
def test_a_publish_with_an_unknown_transport_is_refused_not_counted_as_shm(
    arena: Arena, transport: int
) -> None:
    counted: list[str] = []
    m = _manager(arena, Clock(), [], transfers=counted)
    wf: list[pb.SessionFrame] = []
    w = _session(m, "thinker", wf)
    grant = asyncio.run(m.grant(w, SLOT, 1.0))
    lid = max(m.new_generation_base(grant), grant.last_lease) + 1
    _reserve(m, w, grant, 0, 1, lid)
    m.on_publish(w, pb.Publish(lease_id=lid, nbytes=SLOT, transport=transport))  # type: ignore[arg-type]
    assert m.leases[lid].state is LeaseState.RESERVED and counted == []
    errors = [e for f in wf for e in f.event if e.code == pb.ERROR_CODE_INVALID_ARGUMENT]
    assert len(errors) == 1 and "transport" in errors[0].message
    m.on_publish(w, pb.Publish(lease_id=lid, nbytes=SLOT, transport=pb.TRANSPORT_SHM))
    assert m.leases[lid].state is LeaseState.PUBLISHED and counted == ["shm"]


def test_writer_death_drops_reservations_keeps_published(arena: Arena) -> None:
    clock, reclaimed, wf, rf = Clock(), [], [], []  # type: ignore[var-annotated]
    m = _manager(arena, clock, reclaimed)
    w, r = _session(m, "thinker", wf), _session(m, "talker", rf)
    grant = asyncio.run(m.grant(w, SLOT, 1.0))
    kept = _publish(m, w, grant, 0, 2)
    m.on_reserve(w, pb.Reserve(lease_id=grant.id << 32 | 99, grant_id=grant.id,
                               slot=grant.run.slot + 4, nslots=1, generation=grant.id << 32 | 99,
                               request_id="r", to_stage="talker", from_stage="thinker"))  # fmt: skip
    m.close_session(w.id)
    assert reclaimed == ["writer_died"]
    assert arena.used_bytes == 2 * SLOT  # only the published run survives
    m.on_release(r, pb.Release(lease_id=kept, generation=kept))
    assert arena.used_bytes == 0 and not m.grants


def _seal(arena: Arena, grant, slot: int, lease_id: int, length: int) -> None:  # type: ignore[no-untyped-def]
    """What the client does at publish: the header, before any notice reaches the daemon."""
    arena.segments[grant.run.segment].write_header(grant.run.slot + slot, lease_id, length)


def test_writer_death_publishes_what_it_sealed_but_never_announced(arena: Arena) -> None:
    # Publish notices linger in the client: a writer can die after sealing
    # (and handing out) leases whose Reserve, or Publish, never arrived.
    clock, reclaimed, wf, rf = Clock(), [], [], []  # type: ignore[var-annotated]
    m = _manager(arena, clock, reclaimed)
    w, r = _session(m, "thinker", wf), _session(m, "talker", rf)
    other = _session(m, "critic", [])
    grant = asyncio.run(m.grant(w, SLOT, 1.0))
    base = m.new_generation_base(grant)
    # Reserved and sealed, Publish lost: 2 slots at 0.
    reserved = base + 1
    _reserve(m, w, grant, 0, 2, reserved)
    _seal(arena, grant, 0, reserved, 2 * SLOT - 5)
    # Reserved, never sealed: dropped as before.
    dropped = base + 2
    _reserve(m, w, grant, 5, 1, dropped)
    # Neither notice arrived (notices go in order: nor those of any later
    # lease): 3 slots at 2 (a header on slot 2 only).
    unknown = base + 3
    _seal(arena, grant, 2, unknown, 2 * SLOT + 1)
    # Headers that are not this grant's sealed leases are left alone.
    _seal(arena, grant, 6, (grant.id + 1) << 32 | 7, 10)  # another grant's generation
    _seal(arena, grant, 7, base + 4, 9 * SLOT)  # would run past the grant
    # A reader released the unknown one early (its DataRef came before any notice).
    m.on_release(r, pb.Release(lease_id=unknown, generation=unknown))
    m.close_session(w.id)
    assert reclaimed == ["writer_died"]
    assert m.leases[reserved].state is LeaseState.PUBLISHED
    assert m.leases[reserved].nbytes == 2 * SLOT - 5
    assert unknown not in m.leases  # adopted, then freed by the early release
    assert base + 4 not in m.leases and dropped not in m.leases
    assert arena.used_bytes == 2 * SLOT  # only the sealed, unread lease holds slots
    m.on_release(other, pb.Release(lease_id=reserved, generation=reserved))
    assert reserved in m.leases  # known to be the talker's: the critic may not
    m.on_release(r, pb.Release(lease_id=reserved, generation=reserved))
    assert arena.used_bytes == 0 and not m.grants and not m.leases


@pytest.mark.parametrize("freed_by", ["abort", "ttl"])
def test_a_lease_freed_under_its_push_is_not_adopted_when_its_writer_goes(
    arena: Arena, freed_by: str
) -> None:
    # A push reads the lease's slots: freeing it (abort, TTL) drops the record but
    # keeps the slots, header included, until the push stops. The writer leaving
    # meanwhile must not take that header for a lease it sealed and never announced:
    # that lease would sit on slots the push's end gives back to the arena, to be
    # freed a second time later (two grants on one run).
    clock, reclaimed, wf = Clock(), [], []  # type: ignore[var-annotated]
    m = _manager(arena, clock, reclaimed)
    w = _session(m, "thinker", wf)
    grant = asyncio.run(m.grant(w, SLOT, 1.0))
    lid = _publish(m, w, grant, 0, 2, rid="gone")
    _seal(arena, grant, 0, lid, 2 * SLOT)
    m.hold(m.leases[lid])
    pushed = m.leases[lid]
    if freed_by == "abort":
        assert m.abort(w, "gone") == (1, 2 * SLOT)
    else:
        clock.now += 11.0
        assert m.reap() == 1
    assert lid not in m.leases
    m.close_session(w.id)
    assert lid not in m.leases and not m.leases
    assert arena.used_bytes == 2 * SLOT  # the push still reads them
    m.unhold(pushed)
    assert arena.used_bytes == 0 and not m.grants and not m.leases
    clock.now += 100.0
    assert m.reap() == 0
    assert arena.used_bytes == 0 and reclaimed == [freed_by]


def test_an_adopted_lease_is_any_readers_and_expires_like_any_other(arena: Arena) -> None:
    clock, reclaimed, wf = Clock(), [], []  # type: ignore[var-annotated]
    m = _manager(arena, clock, reclaimed)
    w = _session(m, "thinker", wf)
    critic = _session(m, "critic", [])
    grant = asyncio.run(m.grant(w, SLOT, 1.0))
    base = m.new_generation_base(grant)
    _seal(arena, grant, 0, base + 1, 100)
    _seal(arena, grant, 3, base + 2, 100)
    m.close_session(w.id)
    assert m.leases[base + 1].adopted and m.leases[base + 2].adopted
    # Its stages are unknown: whoever names lease id and generation reads it.
    m.on_release(critic, pb.Release(lease_id=base + 1, generation=base + 1))
    assert base + 1 not in m.leases
    clock.now += 11.0
    assert m.reap() == 1 and reclaimed == ["ttl"]
    assert arena.used_bytes == 0 and not m.grants


def test_a_peer_release_before_the_publish_waits_for_it(arena: Arena) -> None:
    clock, reclaimed, wf = Clock(), [], []  # type: ignore[var-annotated]
    m = _manager(arena, clock, reclaimed)
    w = _session(m, "thinker", wf)
    grant = asyncio.run(m.grant(w, SLOT, 1.0))
    lid = m.new_generation_base(grant) + 1
    _reserve(m, w, grant, 0, 1, lid)
    assert not m.release_from_peer(lid, lid)  # not sealed: the peer's copy is void
    _seal(arena, grant, 0, lid, 10)
    assert not m.release_from_peer(lid, lid + 1)  # wrong generation
    assert m.release_from_peer(lid, lid)  # sealed: good copy, the release waits
    assert m.leases[lid].state is LeaseState.RESERVED
    m.on_publish(w, pb.Publish(lease_id=lid, nbytes=10, transport=pb.TRANSPORT_SHM))
    m.flush()
    assert lid not in m.leases and reclaimed == []
    assert [f.freed.lease_ids for f in wf if f.HasField("freed")] == [[lid]]
    # Before even the Reserve arrived: held for the lease the notices announce.
    early = lid + 1
    assert m.release_from_peer(early, early)
    assert not m.release_from_peer((grant.id + 99) << 32 | 1, (grant.id + 99) << 32 | 1)
    _seal(arena, grant, 1, early, 10)
    _reserve(m, w, grant, 1, 1, early)
    m.on_publish(w, pb.Publish(lease_id=early, nbytes=10, transport=pb.TRANSPORT_SHM))
    assert early not in m.leases and arena.used_bytes == 8 * SLOT  # back in the grant
    assert not m.release_from_peer(early, early)  # announced and freed: nothing to hold


def test_what_a_reader_said_before_the_publish_holds_after_it_is_gone(arena: Arena) -> None:
    # The writer's notices linger, so a reader can read, release and close
    # before the Reserve and Publish land; that must not leave the lease to the TTL.
    clock, reclaimed, wf = Clock(), [], []  # type: ignore[var-annotated]
    m = _manager(arena, clock, reclaimed)
    w = _session(m, "thinker", wf)
    grant = asyncio.run(m.grant(w, SLOT, 1.0))
    base = m.new_generation_base(grant)
    released, claimed, stranger = base + 1, base + 2, base + 3
    r, other = _session(m, "talker", []), _session(m, "bystander", [])
    m.on_release(r, pb.Release(lease_id=released, generation=released))
    m.on_claim(r, pb.Claim(lease_id=claimed, generation=claimed))
    m.on_release(other, pb.Release(lease_id=stranger, generation=stranger))  # not its stage
    m.close_session(r.id)
    m.close_session(other.id)
    for k, lid in enumerate((released, claimed, stranger)):
        _publish(m, w, grant, k, 1, rid=f"r{lid}")
    assert released not in m.leases and claimed not in m.leases
    assert reclaimed == ["reader_died"]  # the claim ended as the reader's death would
    assert m.leases[stranger].state is LeaseState.PUBLISHED
    assert not m.table.early


@dataclasses.dataclass
class _OneLease:
    """A manager, its writer and talker sessions, and one lease published to the talker."""

    m: LeaseManager
    clock: Clock
    reclaimed: list[str]
    r: Session
    lid: int


def _one_lease(arena: Arena) -> _OneLease:
    clock, reclaimed, wf, rf = Clock(), [], [], []  # type: ignore[var-annotated]
    m = _manager(arena, clock, reclaimed)
    w, r = _session(m, "thinker", wf), _session(m, "talker", rf)
    grant = asyncio.run(m.grant(w, SLOT, 1.0))
    return _OneLease(m, clock, reclaimed, r, _publish(m, w, grant, 0, 1))


def test_reader_death_while_claimed_frees(arena: Arena) -> None:
    t = _one_lease(arena)
    t.m.on_claim(t.r, pb.Claim(lease_id=t.lid, generation=t.lid))
    t.m.close_session(t.r.id)
    assert t.reclaimed == ["reader_died"] and t.lid not in t.m.leases


@contextlib.contextmanager
def _release_ring(m: LeaseManager, session_id: str) -> Iterator[IdRing]:
    """The session's end of a Release ring the daemon ``m`` reads."""
    daemon_side, fd = IdRing.create("relayd-release")
    m.releases.attach(session_id, daemon_side)
    client_side = IdRing.map(fd)
    try:
        yield client_side
    finally:
        client_side.close()
        os.close(fd)


def test_a_claim_in_the_readers_ring_frees_the_lease_when_the_reader_dies(arena: Arena) -> None:
    t = _one_lease(arena)
    with _release_ring(t.m, t.r.id) as ring:
        assert ring.push(t.lid | CLAIM_BIT)  # about to copy; dies copying
        t.m.close_session(t.r.id)
    assert t.reclaimed == ["reader_died"] and t.lid not in t.m.leases


def test_the_ttl_spares_a_lease_claimed_in_a_ring_and_its_release_then_frees_it(
    arena: Arena,
) -> None:
    t = _one_lease(arena)
    with _release_ring(t.m, t.r.id) as ring:
        assert ring.push(t.lid | CLAIM_BIT)
        t.clock.now = 11.0  # past the TTL, while the reader copies
        assert t.m.reap() == 0 and t.m.leases[t.lid].state is LeaseState.CLAIMED
        assert ring.push(t.lid)
        t.m.releases.take_all()
    assert t.lid not in t.m.leases and t.reclaimed == []


def test_ttl_reclaims_unread_and_stale_generation_is_ignored(arena: Arena) -> None:
    t = _one_lease(arena)
    t.m.on_release(t.r, pb.Release(lease_id=t.lid, generation=t.lid + 1))  # forged generation
    assert t.lid in t.m.leases
    t.clock.now = 11.0
    assert t.m.reap() == 1 and t.reclaimed == [ReclaimReason.TTL.value]


def test_release_and_abort_need_the_right_stage(arena: Arena) -> None:
    clock, reclaimed, wf, rf, bf = Clock(), [], [], [], []  # type: ignore[var-annotated]
    m = _manager(arena, clock, reclaimed)
    w, r, b = _session(m, "thinker", wf), _session(m, "talker", rf), _session(m, "other", bf)
    grant = asyncio.run(m.grant(w, SLOT, 1.0))
    lid = _publish(m, w, grant, 0, 1, rid="req")
    m.on_release(b, pb.Release(lease_id=lid, generation=lid))
    assert lid in m.leases
    assert any(e.code == pb.ERROR_CODE_PERMISSION_DENIED for f in bf for e in f.event)
    with pytest.raises(PermissionDeniedError):
        m.abort(b, "req")
    assert lid in m.leases
    assert m.abort(r, "req") == (1, SLOT)
    assert m.abort(r, "req") == (0, 0)
    assert any(a.request_id == "req" for f in wf for a in f.aborted)


def test_full_arena_waits_fairly_then_times_out(arena: Arena) -> None:
    clock, reclaimed = Clock(), []  # type: ignore[var-annotated]
    m = _manager(arena, clock, reclaimed)
    a, b = _session(m, "a", []), _session(m, "b", [])

    async def scenario() -> None:
        g1 = await m.grant(a, 20 * SLOT, 1.0)
        with pytest.raises(ResourceExhaustedError):
            await m.grant(b, 20 * SLOT, 0.05)
        first = asyncio.ensure_future(m.grant(b, 16 * SLOT, 5.0))
        second = asyncio.ensure_future(m.grant(a, SLOT, 5.0))
        await asyncio.sleep(0)
        assert not first.done() and not second.done()  # the small one does not overtake
        m.return_grant(a, g1.id)
        assert (await first).run.nslots == 16
        assert (await second).run.nslots >= 1

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_quota_bounds_one_stage(arena: Arena) -> None:
    m = _manager(arena, Clock(), [])
    a = _session(m, "a", [])
    with pytest.raises(ResourceExhaustedError, match="quota"):
        asyncio.run(m.grant(a, 25 * SLOT, 0.05))


def test_freed_notices_linger_into_one_frame_and_a_grant_request_flushes_them(
    arena: Arena,
) -> None:
    clock, wf, rf = Clock(), [], []  # type: ignore[var-annotated]
    m = _manager(arena, clock, [], freed_linger=0.05)
    w, r = _session(m, "thinker", wf), _session(m, "talker", rf)

    async def go() -> None:
        grant = await m.grant(w, SLOT, 1.0)
        ids = [_publish(m, w, grant, slot, 1, rid=f"r{slot}") for slot in range(3)]
        for lid in ids[:2]:
            m.on_release(r, pb.Release(lease_id=lid, generation=lid))
            m.flush()
        assert _freed(wf) == []  # lingering, not lost
        async with asyncio.timeout(5):
            while not _freed(wf):
                await asyncio.sleep(0.01)
        assert _freed(wf) == [ids[:2]]  # both in one frame
        # A writer asking for space gets what is pending at once, before the linger.
        m.on_release(r, pb.Release(lease_id=ids[2], generation=ids[2]))
        m.flush()
        await m.grant(w, SLOT, 1.0)
        assert _freed(wf) == [ids[:2], [ids[2]]]

    asyncio.run(go())


def test_freed_notices_for_large_leases_go_at_once(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The linger holds back at most FREED_LINGER_MAX_BYTES of the writer's arena."""
    from relayd.pools import freed

    monkeypatch.setattr(freed, "FREED_LINGER_MAX_BYTES", 3 * SLOT)
    wf, rf = [], []  # type: ignore[var-annotated]
    m = _manager(arena, Clock(), [], freed_linger=60.0)
    w, r = _session(m, "thinker", wf), _session(m, "talker", rf)

    async def go() -> None:
        grant = await m.grant(w, SLOT, 1.0)
        small = [_publish(m, w, grant, slot, 1, rid=f"s{slot}") for slot in range(2)]
        big = _publish(m, w, grant, 2, 3, rid="big")
        for lid in small:  # 2 slots: below the cap, they linger (a minute, here)
            m.on_release(r, pb.Release(lease_id=lid, generation=lid))
            m.flush()
        assert _freed(wf) == []
        m.on_release(r, pb.Release(lease_id=big, generation=big))
        m.flush()  # now 5 slots' worth: everything pending goes in this turn
        assert _freed(wf) == [[*small, big]]
        last = _publish(m, w, grant, 5, 1, rid="last")
        m.on_release(r, pb.Release(lease_id=last, generation=last))
        m.flush()  # the count started over: one slot lingers again
        assert _freed(wf) == [[*small, big]]

    asyncio.run(go())


def test_freed_notices_linger_per_writer_and_not_while_space_is_short(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relayd.pools import freed

    monkeypatch.setattr(freed, "FREED_LINGER_MAX_BYTES", 2 * SLOT)
    af, bf, rf, hf = [], [], [], []  # type: ignore[var-annotated]
    m = _manager(arena, Clock(), [], freed_linger=60.0)
    a, b = _session(m, "thinker", af), _session(m, "encoder", bf)
    r, hog = _session(m, "talker", rf), _session(m, "hog", hf)

    def release(lease_id: int) -> None:
        m.on_release(r, pb.Release(lease_id=lease_id, generation=lease_id))
        m.flush()

    async def go() -> None:
        ga, gb = await m.grant(a, SLOT, 1.0), await m.grant(b, SLOT, 1.0)
        a1, a2 = (_publish(m, a, ga, k, 1, rid=f"a{k}") for k in range(2))
        b1, b2 = (_publish(m, b, gb, k, 1, rid=f"b{k}") for k in range(2))
        release(a1)
        release(b1)
        assert _freed(af) == _freed(bf) == []  # one slot each: both linger
        release(a2)  # a's two slots reach the cap; b's one does not
        assert _freed(af) == [[a1, a2]] and _freed(bf) == []
        # The hog takes the rest of the arena and asks for more: it waits.
        hog_grant = await m.grant(hog, 16 * SLOT, 1.0)
        waiting = asyncio.ensure_future(m.grant(hog, 8 * SLOT, 5.0))
        await asyncio.sleep(0)
        assert not waiting.done()
        assert _freed(bf) == [[b1]]  # what lingered went when the wait began
        # Every other session, readers without grants included, is asked to
        # send what it holds back and return what it does not use.
        assert any(ev.kind == pb.EVENT_KIND_RECLAIM for f in rf for ev in f.event)
        release(b2)
        assert _freed(bf) == [[b1], [b2]]  # no lingering while space is short
        m.return_grant(hog, hog_grant.id)
        await asyncio.wait_for(waiting, 5)

    asyncio.run(go())


def test_request_records_are_reaped_oldest_first_and_capped(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relayd.pools import requests

    monkeypatch.setattr(requests, "MAX_REQUEST_RECORDS", 5)
    clock, reclaimed, wf, rf = Clock(), [], [], []  # type: ignore[var-annotated]
    m = _manager(arena, clock, reclaimed)
    w, r = _session(m, "thinker", wf), _session(m, "talker", rf)
    grant = asyncio.run(m.grant(w, SLOT, 1.0))
    held = _publish(m, w, grant, 0, 1, rid="held")  # never read: its record must stay
    for i in range(8):
        clock.now += 1
        lid = _publish(m, w, grant, 1 + i % 7, 1, rid=f"done{i}")
        m.on_release(r, pb.Release(lease_id=lid, generation=lid))
    assert len(m.requests) == 9
    m.reap()
    # Over the cap: the oldest lease-less records go first; the held one stays.
    assert list(m.requests) == ["held", "done4", "done5", "done6", "done7"]
    assert held in m.requests["held"].leases
    # A request touched again moves to the young end; age then decides alone:
    # "held" (its lease TTL-reclaimed, touched at 0) goes, the rest are young.
    lid = _publish(m, w, grant, 7, 1, rid="done4")
    m.on_release(r, pb.Release(lease_id=lid, generation=lid))
    clock.now = 6 + requests.REQUEST_MEMORY - 0.5
    m.reap()
    assert reclaimed == ["ttl"]
    assert list(m.requests) == ["done5", "done6", "done7", "done4"]


def test_a_reserve_over_a_lease_cancelled_in_the_same_frame_is_accepted(arena: Arena) -> None:
    # A writer reuses a cancelled lease's slots at once; the daemon handles a
    # frame's reserves before its cancels.
    clock, reclaimed, wf = Clock(), [], []  # type: ignore[var-annotated]
    m = _manager(arena, clock, reclaimed)
    w = _session(m, "thinker", wf)
    grant = asyncio.run(m.grant(w, SLOT, 1.0))
    a, b = m.new_generation_base(grant) + 1, m.new_generation_base(grant) + 2
    reserve = {lid: pb.Reserve(lease_id=lid, grant_id=grant.id, slot=grant.run.slot, nslots=2,
                               generation=lid, request_id="r", to_stage="talker",
                               from_stage="thinker") for lid in (a, b)}  # fmt: skip
    m.on_reserve(w, reserve[a], {a})
    m.on_reserve(w, reserve[b], {a})
    m.on_cancel(w, pb.Cancel(lease_id=a))
    assert list(m.leases) == [b]
    # Without the cancel it is an overlap, and refused.
    c = b + 1
    with pytest.raises(InvalidArgumentError, match="overlap"):
        m.on_reserve(w, pb.Reserve(lease_id=c, grant_id=grant.id, slot=grant.run.slot + 1,
                                   nslots=1, generation=c, request_id="r", to_stage="talker",
                                   from_stage="thinker"), {a})  # fmt: skip


def test_a_double_free_is_refused_and_logged_never_raised(
    arena: Arena, caplog: pytest.LogCaptureFixture
) -> None:
    m = _manager(arena, Clock(), [])
    run = arena.allocate(2)
    assert run is not None
    m.returns.free(run)
    free = arena.free_slots
    with caplog.at_level("ERROR", logger="relayd.pools.returns"):
        m.returns.free(run)  # a bug elsewhere must not reach whichever sweep was freeing
    assert arena.free_slots == free
    assert any("refused to free" in r.getMessage() for r in caplog.records)
