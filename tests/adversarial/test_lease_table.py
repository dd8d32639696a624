"""Hostile Reserve/Claim/Release frames cannot corrupt the daemon's lease table.

Each test is one reproduction: a raw session sends frames a real client never
would, against a real daemon subprocess. What must hold afterwards: the daemon
is alive and serving, no slot is in two grants, the offending session was
closed with an error event, and a well-behaved writer and reader still move
bytes and leave the arena at zero.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from relayd_client import RelayClient
from relayd_client.wire.framing import encode_frame
from relayd_client.wire.proto import relay_pb2 as pb

from tests._daemon import Daemon, wait_until
from tests._figures import record
from tests._workers import digest, make_payload
from tests.adversarial._raw import RawSession, events, read_frames
from tests.faults._support import apoll, quiet, rss_bytes

pytestmark = pytest.mark.timeout(240)

MiB = 1 << 20
TTL = 1.0


@pytest.fixture
def daemon_options() -> dict[str, Any]:
    return {"args": ("--lease-ttl", str(TTL)), "pool": "32MiB"}


def _reserve(g: pb.GrantResponse, seq: int, slot: int, nslots: int = 1, **kw: str) -> pb.Reserve:
    gen = g.generation_base + seq
    fields = {"request_id": "r", "to_stage": "talker", "from_stage": "thinker", **kw}
    return pb.Reserve(
        lease_id=gen, grant_id=g.grant_id, slot=slot, nslots=nslots, generation=gen, **fields
    )


def _publish(g: pb.GrantResponse, seq: int) -> pb.Publish:
    return pb.Publish(lease_id=g.generation_base + seq, nbytes=100, transport=pb.TRANSPORT_SHM)


def _alive_and_drains(d: Daemon) -> None:
    assert d.proc is not None and d.proc.poll() is None, d.log()
    assert d.status()["state"] == "DAEMON_STATE_SERVING"
    _round_trip(d)
    wait_until(lambda: quiet(d), 10, f"arena back to zero: {d.pool()}")


def _round_trip(d: Daemon, *, freed: bool = False) -> None:
    async def scenario() -> None:
        async with (
            RelayClient("thinker", d.socket) as w,
            RelayClient("talker", d.socket) as r,
        ):
            payload = make_payload(11, MiB)
            ref = await w.put(payload, to_stage="talker", request_id="honest")
            assert digest(await r.get(ref)) == digest(payload)
            if freed:
                r._conn.session.flush()  # the release, not lingering
                await apoll(lambda: _told_free(w), 10, "the writer told its lease is free")

    asyncio.run(asyncio.wait_for(scenario(), 60))


def _told_free(w: RelayClient) -> bool:
    """Whether ``w`` holds no lease: by a Freed frame, or its ring as its next cut reads it."""
    w._grants.collect()
    return not w._table.leases


def _overlaps(runs: list[tuple[int, int, int]]) -> list[tuple[tuple[int, int, int], ...]]:
    runs = sorted(runs)
    return [(a, b) for a, b in itertools.pairwise(runs) if a[0] == b[0] and a[1] + a[2] > b[1]]


def _two_leases_on_one_run(d: Daemon) -> tuple[pb.GrantResponse, list[pb.SessionFrame], bool]:
    """A writer announces two published leases over its whole grant, then goes."""
    sess = RawSession(d.socket, "thinker")
    g = sess.grant(MiB)
    sess.send(
        pb.SessionFrame(
            reserve=[_reserve(g, 1, g.slot, g.nslots), _reserve(g, 2, g.slot, g.nslots)],
            publish=[_publish(g, 1), _publish(g, 2)],
        )
    )
    # Gone well before the TTL: the leases' grant is then an orphan's.
    frames, closed = read_frames(sess.sock, TTL / 4)
    sess.close()
    return g, frames, closed


def _refused(frames: list[pb.SessionFrame], closed: bool, word: str) -> None:
    errors = [ev for ev in events(frames) if ev.kind == pb.EVENT_KIND_ERROR]
    assert closed, f"the session stayed open; events: {errors}"
    assert any(word in ev.message for ev in errors), errors


def test_two_leases_on_one_slot_are_refused_and_ttl_cannot_crash_the_daemon(
    daemon: Daemon,
) -> None:
    _g, frames, closed = _two_leases_on_one_run(daemon)
    # What the old daemon died of: its TTL sweep freeing the run twice.
    wait_until(lambda: quiet(daemon), 10, f"TTL sweep done: {daemon.pool()}")
    _alive_and_drains(daemon)
    _refused(frames, closed, "overlap")


def test_two_leases_on_one_slot_cannot_hand_one_slot_to_two_grants(daemon: Daemon) -> None:
    g, frames, closed = _two_leases_on_one_run(daemon)
    # The old daemon kept both: each release gave the run back once more,
    # and two later grants were cut from it.
    reader = RawSession(daemon.socket, "talker")
    holders = [RawSession(daemon.socket, f"holder{i}") for i in range(3)]
    runs: list[tuple[int, int, int]] = []
    for seq, holder in zip((1, 2), holders, strict=False):
        lid = g.generation_base + seq
        reader.send(pb.SessionFrame(release=[pb.Release(lease_id=lid, generation=lid)]))
        read_frames(reader.sock, 0.5)
        h = holder.grant(MiB)
        runs.append((h.segment, h.slot, h.nslots))
    h = holders[2].grant(MiB)
    runs.append((h.segment, h.slot, h.nslots))
    assert not _overlaps(runs), runs
    for s in (reader, *holders):
        s.close()
    _alive_and_drains(daemon)
    _refused(frames, closed, "overlap")


def test_a_session_cannot_take_lease_ids_of_grants_not_yet_issued(daemon: Daemon) -> None:
    squatter = RawSession(daemon.socket, "thinker")
    g = squatter.grant(MiB)
    # Ids of the next grants the daemon will issue, as the old daemon numbered them.
    squats = []
    for ahead in range(1, 9):
        lid = ((g.grant_id + ahead) << 32) | 1
        squats.append(
            pb.Reserve(lease_id=lid, grant_id=g.grant_id, slot=g.slot + ahead, nslots=1,
                       generation=g.generation_base + ahead, request_id="r", to_stage="talker",
                       from_stage="thinker")
        )  # fmt: skip
    squatter.send(pb.SessionFrame(reserve=squats))
    frames, closed = read_frames(squatter.sock, 2)
    # The next writers' leases are theirs: published, read, and freed back to
    # the writer (the old daemon refused their Reserve and never freed them).
    for _ in range(3):
        _round_trip(daemon, freed=True)
    squatter.close()
    _alive_and_drains(daemon)
    _refused(frames, closed, "lease id")


def test_lease_ids_cannot_be_replayed_inside_a_grant(daemon: Daemon) -> None:
    sess = RawSession(daemon.socket, "thinker")
    g = sess.grant(MiB)
    sess.send(pb.SessionFrame(reserve=[_reserve(g, 5, g.slot)]))
    sess.send(pb.SessionFrame(cancel=[pb.Cancel(lease_id=g.generation_base + 5)]))
    sess.send(pb.SessionFrame(reserve=[_reserve(g, 5, g.slot)]))  # the same id again
    frames, closed = read_frames(sess.sock, 2)
    sess.close()
    _refused(frames, closed, "lease id")
    _alive_and_drains(daemon)


def _flood(sess: RawSession, frames: Iterator[pb.SessionFrame]) -> tuple[int, bool]:
    """Send frames until done or the daemon closes the session: (frames sent, closed)."""
    sent = 0
    for f in frames:
        try:
            sess.sock.sendall(encode_frame(f))
        except (BrokenPipeError, ConnectionResetError):
            return sent, True
        sent += 1
    _frames, closed = read_frames(sess.sock, 5)
    return sent, closed


def test_a_reserve_flood_on_one_slot_does_not_grow_the_daemon(daemon: Daemon) -> None:
    total, batch = 300_000, 5_000
    sess = RawSession(daemon.socket, "thinker")
    g = sess.grant(MiB)
    rss_before = rss_bytes(daemon.pid)

    def frames() -> Iterator[pb.SessionFrame]:
        for start in range(1, total + 1, batch):
            yield pb.SessionFrame(
                reserve=[_reserve(g, seq, g.slot) for seq in range(start, start + batch)]
            )

    sent, closed = _flood(sess, frames())
    sess.close()
    assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log()
    growth = rss_bytes(daemon.pid) - rss_before
    record(
        "reserve flood",
        f"{sent * batch} Reserves on one slot sent, session closed: {closed}; "
        f"daemon RSS growth {growth >> 10} KiB",
    )
    assert closed
    assert growth < 32 * MiB
    _alive_and_drains(daemon)


def test_a_claim_flood_for_one_unknown_lease_does_not_grow_the_daemon(daemon: Daemon) -> None:
    total, batch = 1_000_000, 20_000
    writer = RawSession(daemon.socket, "thinker")
    g = writer.grant(MiB)  # a live grant: ids in it may still be announced
    flooder = RawSession(daemon.socket, "talker")
    lid = g.generation_base + 7
    rss_before = rss_bytes(daemon.pid)
    one = pb.SessionFrame(claim=[pb.Claim(lease_id=lid, generation=lid)] * batch)

    def frames() -> Iterator[pb.SessionFrame]:
        for _ in range(total // batch):
            yield one

    sent, closed = _flood(flooder, frames())
    flooder.close()
    writer.close()
    assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log()
    growth = rss_bytes(daemon.pid) - rss_before
    record(
        "early-claim flood",
        f"{sent * batch} Claims of one unannounced lease sent, session closed: {closed}; "
        f"daemon RSS growth {growth >> 10} KiB",
    )
    assert closed
    assert growth < 32 * MiB
    _alive_and_drains(daemon)


def test_claims_for_ids_of_no_grant_are_not_kept(daemon: Daemon) -> None:
    flooder = RawSession(daemon.socket, "talker")
    rss_before = rss_bytes(daemon.pid)
    batch = 20_000

    def frames() -> Iterator[pb.SessionFrame]:
        for i in range(10):
            base = (1_000_000 + i) << 32
            yield pb.SessionFrame(
                claim=[pb.Claim(lease_id=base + n, generation=base + n) for n in range(1, batch)]
            )

    sent, _closed = _flood(flooder, frames())
    growth = rss_bytes(daemon.pid) - rss_before
    record(
        "claims of ids of no grant",
        f"{sent * batch} Claims sent; daemon RSS growth {growth >> 10} KiB",
    )
    assert growth < 32 * MiB
    flooder.close()
    _alive_and_drains(daemon)


def test_raw_sockets_closed_mid_flood_leave_nothing(daemon: Daemon) -> None:
    # Half a frame, then gone: the session's leases are reclaimed as for any death.
    sess = RawSession(daemon.socket, "thinker")
    g = sess.grant(MiB)
    body = encode_frame(pb.SessionFrame(reserve=[_reserve(g, 1, g.slot)]))
    sess.sock.sendall(body[: len(body) // 2])
    sess.sock.shutdown(socket.SHUT_RDWR)
    sess.close()
    _alive_and_drains(daemon)
