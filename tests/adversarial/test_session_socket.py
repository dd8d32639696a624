"""Garbage, oversized and forged frames on the session socket; one session against another."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import struct
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import pytest
from relayd_client import (
    DataRef,
    PeerUnavailableError,
    PermissionDeniedError,
    RelayClient,
    SyncRelayClient,
)
from relayd_client.wire.framing import encode_frame
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.rings import CLAIM_BIT

from tests._daemon import Daemon, metric, wait_until
from tests._figures import count, record
from tests._workers import digest, make_payload
from tests.adversarial._raw import RawSession, events, read_frames, stub
from tests.faults._support import rss_bytes

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
T = TypeVar("T")


@pytest.fixture
def daemon_options() -> dict[str, Any]:
    return {"pool": "32MiB", "metrics": True}


def _connect(d: Daemon) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(d.socket + ".session")
    return s


def test_garbage_and_forged_frames_close_only_that_connection(daemon: Daemon) -> None:
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    rss_before = rss_bytes(daemon.pid)
    closed = 0
    cases = 0
    bodies: list[bytes] = [struct.pack("<I", 1 << 31) + b"x" * 16]  # length prefix 2^31
    bodies.append(struct.pack("<I", (4 << 20) + 1))  # one byte over the frame limit
    # a release before any bind
    bodies.append(encode_frame(pb.SessionFrame(release=[pb.Release(lease_id=1, generation=1)])))
    bodies.append(
        encode_frame(pb.SessionFrame(bind=pb.Bind(session_id="s1-x", session_token=b"bad")))
    )
    for _ in range(60):
        junk = rng.randbytes(rng.randrange(1, 300))
        bodies.append(struct.pack("<I", len(junk)) + junk)  # a complete frame of random bytes
    for body in bodies:
        s = _connect(daemon)
        s.sendall(body)
        _frames, was_closed = read_frames(s, 5)
        s.close()
        cases += 1
        closed += was_closed
        count("raw session frames fuzzed")
    # A session bound with a stolen id but the wrong token is refused too.
    victim = RawSession(daemon.socket, "thinker")
    s = _connect(daemon)
    s.sendall(
        encode_frame(
            pb.SessionFrame(
                bind=pb.Bind(session_id=victim.attach.session_id, session_token=b"0" * 16)
            )
        )
    )
    frames, was_closed = read_frames(s, 5)
    assert was_closed and events(frames)[0].kind == pb.EVENT_KIND_ERROR
    s.close()
    victim.close()
    assert closed == cases, f"{cases - closed} bad connections stayed open"
    st = daemon.status()
    assert st["state"] == "DAEMON_STATE_SERVING"
    growth = rss_bytes(daemon.pid) - rss_before
    record(
        "session-socket garbage",
        f"{cases} bad connections, all closed; RSS growth {growth >> 10} KiB",
    )
    assert growth < 32 * MiB


def test_reserve_outside_grant_and_spoofed_writer_are_refused(daemon: Daemon) -> None:
    def outside(g: pb.GrantResponse, gen: int) -> pb.Reserve:
        return pb.Reserve(lease_id=gen, grant_id=g.grant_id, slot=g.slot + g.nslots, nslots=1,
                          generation=gen, request_id="r", to_stage="talker",
                          from_stage="intruder")  # fmt: skip

    def not_held(g: pb.GrantResponse, gen: int) -> pb.Reserve:
        return pb.Reserve(lease_id=gen, grant_id=g.grant_id + 999, slot=g.slot, nslots=1,
                          generation=gen, request_id="r", to_stage="talker",
                          from_stage="intruder")  # fmt: skip

    def spoofed(g: pb.GrantResponse, gen: int) -> pb.Reserve:
        return pb.Reserve(lease_id=gen, grant_id=g.grant_id, slot=g.slot, nslots=1,
                          generation=gen, request_id="r", to_stage="talker",
                          from_stage="thinker")  # fmt: skip

    for make in (outside, not_held, spoofed):
        # Each closes the session that sent it, with an error saying why.
        sess = RawSession(daemon.socket, "intruder")
        g = sess.grant(MiB)
        sess.send(pb.SessionFrame(reserve=[make(g, g.generation_base + 1)]))
        frames, was_closed = read_frames(sess.sock, 5)
        assert was_closed, make.__name__
        evs = events(frames)
        assert evs and evs[0].kind == pb.EVENT_KIND_ERROR, make.__name__
        count("forged session notices")
        sess.close()
    assert daemon.status()["leases_by_state"].get("reserved", "0") == "0"
    assert daemon.status()["state"] == "DAEMON_STATE_SERVING"


def test_a_session_cannot_release_claim_or_abort_another_stages_lease(daemon: Daemon) -> None:
    async def scenario() -> None:
        async with (
            RelayClient("thinker", daemon.socket) as w,
            RelayClient("talker", daemon.socket) as r,
            RelayClient("bystander", daemon.socket) as b,
        ):
            payload = make_payload(1, MiB)
            ref = await w.put(payload, to_stage="talker", request_id="req")
            lease = ref.proto.lease
            intruder = await asyncio.to_thread(RawSession, daemon.socket, "bystander")
            for notice in (
                pb.SessionFrame(
                    claim=[pb.Claim(lease_id=lease.lease_id, generation=lease.generation)]
                ),
                pb.SessionFrame(
                    release=[pb.Release(lease_id=lease.lease_id, generation=lease.generation)]
                ),
                pb.SessionFrame(cancel=[pb.Cancel(lease_id=lease.lease_id)]),
            ):
                intruder.send(notice)
                frames, _ = await asyncio.to_thread(read_frames, intruder.sock, 1)
                count("cross-session notices")
                if not notice.HasField("bind") and not notice.cancel:
                    assert any(
                        ev.code == pb.ERROR_CODE_PERMISSION_DENIED for ev in events(frames)
                    ), notice
            assert daemon.status()["leases_by_state"]["published"] == "1"
            # The bystander's abort of someone else's request is refused...
            with pytest.raises(PermissionDeniedError):
                await b.abort("req")
            # ... and aborting a request before it exists does not touch it either.
            await b.abort("future")
            fut = await w.put(make_payload(2, MiB), to_stage="talker", request_id="future")
            assert digest(await r.get(fut)) == digest(make_payload(2, MiB))
            # The real reader still gets every byte.
            assert digest(await r.get(ref)) == digest(payload)
            intruder.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_publish_carried_in_a_reserve_publishes_nothing_but_that_reserve(
    daemon: Daemon,
) -> None:
    # A Reserve of the intruder's own grant carrying a Publish that names the
    # thinker's lease, with push and an absurd length: refused, the intruder's
    # lease stays unpublished, and the talker still reads every byte.
    async def scenario() -> None:
        async with (
            RelayClient("thinker", daemon.socket) as w,
            RelayClient("talker", daemon.socket) as r,
        ):
            payload = make_payload(3, MiB)
            ref = await w.put(payload, to_stage="talker", request_id="req")
            w._conn.flush()
            intruder = await asyncio.to_thread(RawSession, daemon.socket, "intruder")
            g = await asyncio.to_thread(intruder.grant, MiB)
            gen = g.generation_base + 1
            forged = pb.Reserve(lease_id=gen, grant_id=g.grant_id, slot=g.slot, nslots=1,
                                generation=gen, request_id="req", to_stage="talker",
                                from_stage="intruder")  # fmt: skip
            forged.publish.lease_id = ref.proto.lease.lease_id
            forged.publish.nbytes = 1 << 40
            forged.publish.transport = pb.TRANSPORT_SHM
            forged.publish.push = True
            intruder.send(pb.SessionFrame(reserve=[forged]))
            errors = await asyncio.to_thread(_collect, intruder, _errors, 1, "errors")
            count("forged session notices")
            st = await asyncio.to_thread(daemon.status)
            assert st["leases_by_state"] == {"reserved": "1", "published": "1", "claimed": "0"}
            # The frame was handled whole before the first error went; a second
            # error of it would be in the socket by now (the Status came after).
            later, closed = await asyncio.to_thread(read_frames, intruder.sock, 0.1)
            assert not closed
            assert [ev.code for ev in errors + events(later) if ev.kind == pb.EVENT_KIND_ERROR] == [
                pb.ERROR_CODE_INVALID_ARGUMENT
            ]
            assert digest(await r.get(ref)) == digest(payload)
            intruder.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert daemon.status()["state"] == "DAEMON_STATE_SERVING"


def test_abort_flood_does_not_grow_the_daemon(daemon: Daemon) -> None:
    sess = RawSession(daemon.socket, "flooder")
    rss_before = rss_bytes(daemon.pid)
    with stub(daemon.socket) as s:
        for i in range(3000):
            s.Abort(
                pb.AbortRequest(
                    session_id=sess.attach.session_id,
                    session_token=sess.attach.session_token,
                    request_id=f"{i:x}" * 30,
                ),
                timeout=5,
            )
    count("abort tombstones flooded", 3000)
    growth = rss_bytes(daemon.pid) - rss_before
    record("abort flood", f"3000 aborts of unknown requests; daemon RSS growth {growth >> 10} KiB")
    assert growth < 32 * MiB
    sess.close()


def _collect(
    sess: RawSession,
    pick: Callable[[pb.SessionFrame], Iterable[T]],
    want: int,
    what: str,
    timeout: float = 10.0,
) -> list[T]:
    """Read frames until ``want`` of what ``pick`` finds in them arrived (or fail at
    the deadline); the session must stay open."""
    deadline = time.monotonic() + timeout
    got: list[T] = []
    while len(got) < want:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(got)} of {want} {what} arrived"
        frames, closed = read_frames(sess.sock, min(left, 0.5))
        assert not closed
        got += [x for f in frames for x in pick(f)]
    return got


def _fetch_results(sess: RawSession, want: int) -> list[pb.FetchResult]:
    return _collect(sess, lambda f: f.fetched, want, "fetch results")


def _errors(f: pb.SessionFrame) -> list[pb.Event]:
    return [ev for ev in f.event if ev.kind == pb.EVENT_KIND_ERROR]


def test_fetch_calls_on_the_session_are_answered_with_exact_codes(daemon: Daemon) -> None:
    # This daemon has no peers: a cross-node read fails as PEER_UNAVAILABLE,
    # answered on the call's id, and the session stays usable.
    sess = RawSession(daemon.socket, "reader")
    sess.send(pb.SessionFrame(fetch=[pb.FetchCall(call_id=7, data_ref=b"x", timeout_seconds=1)]))
    (result,) = _fetch_results(sess, 1)
    assert result.call_id == 7 and not result.HasField("response")
    assert result.code == pb.ERROR_CODE_PEER_UNAVAILABLE, result
    # NaN and negative timeouts fall back to the default; many calls in one frame
    # are all answered, each on its own id.
    calls = [pb.FetchCall(call_id=100 + i, data_ref=b"", timeout_seconds=t)
             for i, t in enumerate((float("nan"), -1.0, 0.0, 1e300))]  # fmt: skip
    sess.send(pb.SessionFrame(fetch=calls))
    results = _fetch_results(sess, len(calls))
    assert sorted(r.call_id for r in results) == [100, 101, 102, 103]
    assert {r.code for r in results} == {pb.ERROR_CODE_PEER_UNAVAILABLE}
    count("session fetch calls refused", 1 + len(calls))
    sess.close()

    # The real client takes the same road: a foreign DataRef read here is a
    # PeerUnavailableError, not a hang and not a crash.
    async def scenario() -> None:
        async with (
            RelayClient("thinker", daemon.socket) as w,
            RelayClient("talker", daemon.socket) as r,
        ):
            payload = make_payload(3, MiB)
            ref = await w.put(payload, to_stage="talker", request_id="q")
            foreign = pb.DataRef()
            foreign.CopyFrom(ref.proto)
            foreign.origin.node_id = "elsewhere"  # as if another node's daemon wrote it
            with pytest.raises(PeerUnavailableError, match="no peers"):
                await r.get(DataRef(foreign))
            # ... and the session still serves the local original.
            assert digest(await r.get(ref)) == digest(payload)

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_ids_scribbled_into_a_release_ring_free_nothing_of_another_stage(daemon: Daemon) -> None:
    """The Release ring is the client's memory: whatever it holds is judged like notices."""

    async def scenario() -> None:
        async with (
            RelayClient("thinker", daemon.socket) as w,
            RelayClient("talker", daemon.socket) as r,
            RelayClient("bystander", daemon.socket) as b,
        ):
            payload = make_payload(3, MiB)
            ref = await w.put(payload, to_stage="talker", request_id="req")
            lease = ref.proto.lease
            ring = b._conn.session.release_ring
            assert ring is not None
            rng = random.Random(int.from_bytes(os.urandom(4), "little"))
            grant = lease.lease_id >> 32
            scribbled = [lease.lease_id, lease.lease_id | CLAIM_BIT]  # the talker's lease
            scribbled += [(grant << 32) | n for n in range(2, 40)]  # its grant's next ids
            scribbled += [(grant << 32) | n | CLAIM_BIT for n in range(2, 40)]
            scribbled += [rng.getrandbits(64) | 1 for _ in range(60)]  # anything at all
            scribbled.append(rng.getrandbits(63) | 1)  # a release last: its count says all went
            for word in scribbled:
                assert ring.push(word)
            taken = sum(1 for word in scribbled if not word & CLAIM_BIT)  # claims aren't counted
            # The daemon takes rings on its timer while a lease is out, at the latest.
            await asyncio.to_thread(
                wait_until,
                lambda: (
                    metric(daemon.scrape(), "relayd_released_leases_total", via="ring") >= taken
                ),
                10,
                "the bystander's ring taken",
            )
            # Not claimed by the bystander either: the talker's release would be refused.
            states = daemon.status()["leases_by_state"]
            assert (states["published"], states["claimed"]) == ("1", "0")
            # The real reader still gets every byte, and its Release frees the lease.
            assert digest(await r.get(ref)) == digest(payload)
            await asyncio.to_thread(
                wait_until,
                lambda: daemon.pool().get("used_bytes", 0) == 0,
                10,
                "the talker's release taken",
            )

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_session_that_reads_none_of_its_answers_is_dropped_not_buffered(
    daemon: Daemon,
) -> None:
    """Each fetch call is answered, so a client that sends them and never reads
    would make the daemon buffer answers without end: one 4 MiB frame of calls
    holds about ten times that in answers. Past a bound the connection goes,
    the daemon stays small, and other sessions go on."""
    sess = RawSession(daemon.socket, "hoarder")
    sess.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    rss_before = rss_bytes(daemon.pid)
    calls = [pb.FetchCall(call_id=i, data_ref=b"\x00") for i in range(1, 200_001)]
    frames = [pb.SessionFrame(fetch=calls[i : i + 50_000]) for i in range(0, len(calls), 50_000)]
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        for f in frames:
            sess.send(f)
    wait_until(
        lambda: "frames unread" in daemon.log(),
        60,
        "the daemon to drop the session it buffered for",
    )
    growth = rss_bytes(daemon.pid) - rss_before
    record(
        "unread answers",
        f"{len(calls)} fetch calls never read; daemon RSS growth {growth >> 10} KiB",
    )
    assert growth < 64 * MiB
    assert _closed_after_draining(sess.sock, 30), "the daemon kept the session that reads nothing"
    sess.close()
    assert metric(daemon.scrape(), "relayd_connections_refused_total", reason="unread") == 1
    with (
        SyncRelayClient("thinker", daemon.socket) as w,
        SyncRelayClient("talker", daemon.socket) as r,
    ):
        ref = w.put(make_payload(7, 1024), to_stage="talker", request_id="after")
        assert digest(r.get(ref)) == digest(make_payload(7, 1024))


def _closed_after_draining(s: socket.socket, timeout: float) -> bool:
    """Read whatever the daemon wrote until it closed the socket (True) or ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            if not s.recv(1 << 20):
                return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
    return False


def test_a_client_cannot_write_into_its_announcement_socket(daemon: Daemon) -> None:
    """The daemon's end of a blocking client's announcement socket reads nothing:
    the client's writes fail at once, so it can pin no daemon-side buffer, and
    its session (and an async client's, which has no such socket) carries on."""
    with (
        SyncRelayClient("thinker", daemon.socket) as w,
        SyncRelayClient("talker", daemon.socket) as r,
    ):
        apart = r._client._conn.session.apart
        assert apart is not None and apart._sock is not None
        assert apart._sock.type == socket.SOCK_SEQPACKET
        with pytest.raises(BrokenPipeError):
            apart._sock.send(b"\0" * 1024)
        payload = make_payload(5, MiB)
        ref = w.put(payload, to_stage="talker", request_id="after")
        assert digest(r.get(ref.to_bytes())) == digest(payload)

    async def scenario() -> None:
        async with RelayClient("talker", daemon.socket) as c:
            assert c._conn.session.apart is None  # its loop hears announcements itself

    asyncio.run(asyncio.wait_for(scenario(), 30))
    wait_until(lambda: daemon.pool().get("used_bytes", 0) == 0, 10, "the arena back to zero")
