"""Lease rules of cross-node pulls (both sides) and the peer settings' checks."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Iterator

import pytest
from relayd_client import AbortedError, PermissionDeniedError
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.peer_links import PeerConfigError, _resolve, load_token
from relayd.pools.arena import Arena
from relayd.pools.leases import LeaseManager
from relayd.pools.records import LeaseState
from relayd.rpc.frames import frame_sink
from tests.unit._pools import SLOT, unit_arena


@pytest.fixture
def arena() -> Iterator[Arena]:
    with unit_arena(16) as a:
        yield a


def _manager(arena: Arena) -> LeaseManager:
    return LeaseManager(
        arena, grant_bytes=4 * SLOT, lease_ttl=10.0, stage_quota_bytes=12 * SLOT, max_sessions=8
    )


def _reader(m: LeaseManager, frames: list[pb.SessionFrame]):  # type: ignore[no-untyped-def]
    s = m.open_session(pid=1, stages=["talker"])
    return m.bind(s.id, s.token, frame_sink(frames.append), pid=1, uid=0, gid=0)


def test_pull_lease_is_daemon_owned_and_freed_by_the_readers_release(arena: Arena) -> None:
    m = _manager(arena)
    r = _reader(m, [])

    async def go() -> None:
        lease = await m.crossnode.reserve_for_pull(
            r, 3 * SLOT - 5, 1.0, request_id="q", from_stage="thinker", to_stage="talker"
        )
        assert lease.state is LeaseState.RESERVED and lease.run.nslots == 3
        assert r.granted_slots == 0 and not r.grants  # the daemon owns the run
        assert arena.used_bytes == 3 * SLOT
        m.crossnode.publish_pull(lease, 3 * SLOT - 5)
        assert arena.header(lease.run.segment, lease.run.slot) == (lease.generation, 3 * SLOT - 5)
        m.on_claim(r, pb.Claim(lease_id=lease.id, generation=lease.generation))
        m.on_release(r, pb.Release(lease_id=lease.id, generation=lease.generation))
        assert not m.leases and arena.used_bytes == 0
        assert arena.header(lease.run.segment, lease.run.slot) == (0, 0)

    asyncio.run(go())


def test_failed_pull_is_dropped_and_aborted_pull_never_published(arena: Arena) -> None:
    m = _manager(arena)
    r = _reader(m, [])

    async def go() -> None:
        lease = await m.crossnode.reserve_for_pull(
            r, SLOT, 1.0, request_id="q", from_stage="thinker", to_stage="talker"
        )
        m.abort(r, "q")  # RESERVED: abort leaves it to the pull, which must not publish
        assert lease.id in m.leases
        with pytest.raises(AbortedError):
            m.crossnode.publish_pull(lease, SLOT)
        assert not m.leases and arena.used_bytes == 0
        other = await m.crossnode.reserve_for_pull(
            r, SLOT, 1.0, request_id="q2", from_stage="thinker", to_stage="talker"
        )
        m.crossnode.drop_pull(other)
        m.crossnode.drop_pull(other)  # idempotent
        assert arena.used_bytes == 0

    asyncio.run(go())


def test_release_from_peer_checks_generation_and_state(arena: Arena) -> None:
    m = _manager(arena)
    frames: list[pb.SessionFrame] = []
    w = m.open_session(pid=1, stages=["thinker"])
    w = m.bind(w.id, w.token, frame_sink(frames.append), pid=1, uid=0, gid=0)

    async def go() -> None:
        grant = await m.grant(w, SLOT, 1.0)
        lid = m.new_generation_base(grant) + 1
        m.on_reserve(w, pb.Reserve(lease_id=lid, grant_id=grant.id, slot=grant.run.slot,
                                   nslots=1, generation=lid, request_id="q", to_stage="talker",
                                   from_stage="thinker"))  # fmt: skip
        assert not m.release_from_peer(lid, lid)  # not published yet: the copy is void
        m.on_publish(w, pb.Publish(lease_id=lid, nbytes=10, transport=pb.TRANSPORT_SHM))
        assert not m.release_from_peer(lid, lid + 1)  # wrong generation
        assert m.release_from_peer(lid, lid)
        assert not m.release_from_peer(lid, lid)  # already gone
        assert any(f.HasField("freed") and lid in f.freed.lease_ids for f in frames)

    asyncio.run(go())


def test_a_pulls_release_frees_only_a_lease_addressed_to_the_pulling_reader(
    arena: Arena,
) -> None:
    m = _manager(arena)
    w = m.open_session(pid=1, stages=["thinker"])
    w = m.bind(w.id, w.token, lambda f: None, pid=1, uid=0, gid=0)

    async def go() -> None:
        grant = await m.grant(w, SLOT, 1.0)
        base = m.new_generation_base(grant)

        def reserve(lid: int, slot: int) -> None:
            m.on_reserve(w, pb.Reserve(lease_id=lid, grant_id=grant.id, slot=grant.run.slot + slot,
                                       nslots=1, generation=lid, request_id="q",
                                       to_stage="talker", from_stage="thinker"))  # fmt: skip

        published, early = base + 1, base + 2
        reserve(published, 0)
        m.on_publish(w, pb.Publish(lease_id=published, nbytes=10, transport=pb.TRANSPORT_SHM))
        # The lease's own to_stage decides, whatever the DataRef the peer was handed says.
        with pytest.raises(PermissionDeniedError, match="talker"):
            m.release_from_peer(published, published, ["eavesdropper"])
        assert published in m.leases
        assert m.release_from_peer(published, published, ["talker"])
        # The same holds for a release that overtakes the Publish.
        assert m.release_from_peer(early, early, ["eavesdropper"])  # parked
        reserve(early, 1)
        m.on_publish(w, pb.Publish(lease_id=early, nbytes=10, transport=pb.TRANSPORT_SHM))
        assert early in m.leases
        # The daemon's own free (no reader stages) frees it unread.
        assert m.release_from_peer(early, early)
        assert early not in m.leases

    asyncio.run(go())


def test_peer_token_file_is_required_and_checked(tmp_path: pathlib.Path) -> None:
    with pytest.raises(PeerConfigError, match="needs --peer-token-file"):
        load_token("")
    with pytest.raises(PeerConfigError, match="cannot read"):
        load_token(str(tmp_path / "missing"))
    short = tmp_path / "short"
    short.write_text("abc\n")
    short.chmod(0o600)
    with pytest.raises(PeerConfigError, match="shorter than 16"):
        load_token(str(short))
    good = tmp_path / "good"
    good.write_text("  0123456789abcdef0123 \n")
    for mode in (0o644, 0o602, 0o604):
        good.chmod(mode)
        with pytest.raises(PeerConfigError) as err:
            load_token(str(good))
        assert str(err.value) == (
            f"--peer-token-file {good} is open to every user on this host (mode {mode:04o}); "
            f"make it private: chmod 600 {good} (or 640 with relayd's group)"
        )
    for mode in (0o600, 0o640, 0o400):
        good.chmod(mode)
        assert load_token(str(good)) == b"0123456789abcdef0123"


def test_peer_entries_resolve_to_every_address() -> None:
    assert _resolve("127.0.0.1:9092") == ["127.0.0.1:9092"]
    assert "127.0.0.1:7" in _resolve("localhost:7")
