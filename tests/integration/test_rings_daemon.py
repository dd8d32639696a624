"""The Freed and Release rings against a real daemon: news that wakes nobody.

Writers hear what is free without a Freed frame; readers' Releases reach the
daemon without a frame of theirs. Each test counts what still went by frame,
which the rings exist to replace, and checks the bytes and the arena as always.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from relayd_client import DataRef, RelayClient, SyncRelayClient
from relayd_client.wire.framing import (
    FRAME_LENGTH,
    NOTICE_LINGER_MAX_BYTES,
    PROMPT_NOTICE_BYTES,
)
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.rings import RING_SLOTS

from tests._daemon import Daemon, drained, metric, run_worker, running_daemon, wait_until
from tests._fixtures import separate_processes
from tests._workers import digest, make_payload

__all__ = ["separate_processes"]  # the autouse fixture: clients here use the arena

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def _freed_by_frame(client: RelayClient) -> list[int]:
    """The lease ids each Freed frame to ``client`` carries, from now on."""
    channel = client._conn.session
    seen: list[int] = []
    handle = channel._on_frame

    def on_frame(frame: Any) -> None:
        if frame.HasField("freed"):
            seen.extend(frame.freed.lease_ids)
        handle(frame)

    channel._on_frame = on_frame
    return seen


def _freed(d: Daemon, via: str) -> float:
    return metric(d.scrape(), "relayd_freed_leases_total", via=via)


def _released(d: Daemon, via: str) -> float:
    return metric(d.scrape(), "relayd_released_leases_total", via=via)


def _relayed(
    w: SyncRelayClient, r: SyncRelayClient, seed: int, size: int, request_id: str
) -> DataRef:
    """Put a payload from ``w``, get it at ``r`` with the same bytes; its DataRef."""
    payload = make_payload(seed, size)
    ref = w.put(payload, to_stage="talker", request_id=request_id, timeout=30)
    assert digest(r.get(ref)) == digest(payload)
    return ref


def _slot(ref: DataRef) -> tuple[int, int]:
    return ref.proto.lease.segment, ref.proto.lease.slot


def test_a_blocking_writer_reuses_its_slots_with_no_freed_frame(tmp_path: object) -> None:
    with running_daemon(str(tmp_path), pool="64MiB", metrics=True) as d:
        with (
            SyncRelayClient("thinker", d.socket) as w,
            SyncRelayClient("talker", d.socket) as r,
        ):
            assert w._client._grants.ring is not None
            by_frame = _freed_by_frame(w._client)
            slots = set()
            for i in range(40):
                ref = _relayed(w, r, i, MiB, f"r{i}")
                slots.add(_slot(ref))
            assert by_frame == []
            # Told nothing, the writer would take new slots for every put.
            assert len(slots) < 20
            wait_until(lambda: _freed(d, "ring") >= 40, 10, "the daemon counts its ring writes")
            assert _freed(d, "frame") == 0
        wait_until(lambda: drained(d), 10, "arena back to zero")


def test_the_async_client_reads_its_ring_too(tmp_path: object) -> None:
    async def scenario(sock: str) -> tuple[list[int], int]:
        async with RelayClient("thinker", sock) as w, RelayClient("talker", sock) as r:
            assert w._grants.ring is not None
            by_frame = _freed_by_frame(w)
            slots = set()
            for i in range(30):
                payload = make_payload(i, 2 * MiB)
                ref = await w.put(payload, to_stage="talker", request_id=f"a{i}", timeout=30)
                slots.add(_slot(ref))
                assert digest(await r.get(ref)) == digest(payload)
            return by_frame, len(slots)

    with running_daemon(str(tmp_path), pool="64MiB") as d:
        by_frame, nslots = asyncio.run(asyncio.wait_for(scenario(d.socket), 60))
        assert by_frame == [] and nslots < 15
        wait_until(lambda: drained(d), 10, "arena back to zero")


def test_a_writer_that_never_reads_its_ring_gets_frames(tmp_path: object) -> None:
    """Whatever the writer leaves in its ring, the daemon only falls back to frames."""
    with running_daemon(str(tmp_path), pool="64MiB", metrics=True) as d:
        with (
            SyncRelayClient("thinker", d.socket) as w,
            SyncRelayClient("talker", d.socket) as r,
        ):
            grants = w._client._grants
            ring, grants.ring = grants.ring, None
            assert ring is not None
            for i in range(RING_SLOTS):  # a full ring of garbage
                ring._words[i] = 0xFFFF_FFFF_0000_0000 | i
            by_frame = _freed_by_frame(w._client)
            refs = []
            for i in range(20):
                ref = _relayed(w, r, i, MiB, f"g{i}")
                refs.append(ref.proto.lease.lease_id)
            wait_until(lambda: set(refs) <= set(by_frame), 10, "every lease freed by frame")
            assert _freed(d, "frame") >= len(refs) and _freed(d, "ring") == 0
            assert d.pool().get("used_bytes", 0) == 0
        wait_until(lambda: drained(d), 10, "arena back to zero")


@pytest.mark.skipif(os.geteuid() != 0, reason="/proc/self/map_files needs root")
def test_a_writer_cannot_truncate_the_ring_under_the_daemon(tmp_path: object) -> None:
    """The daemon maps the rings too: a shrunk one would fault it (SIGBUS) where it reads or
    writes."""
    with running_daemon(str(tmp_path), pool="64MiB") as d:
        with (
            SyncRelayClient("thinker", d.socket) as w,
            SyncRelayClient("talker", d.socket) as r,
        ):
            with open("/proc/self/maps") as maps:
                rings = [ln.split()[0] for ln in maps if "memfd:relayd-" in ln]
            assert len(rings) == 4  # a Freed and a Release ring for each of the two sessions
            for span in rings:
                fd = os.open(f"/proc/self/map_files/{span}", os.O_RDWR)
                try:
                    with pytest.raises(PermissionError):
                        os.ftruncate(fd, 0)
                finally:
                    os.close(fd)
            for i in range(3):
                _relayed(w, r, i, MiB, f"t{i}")
            assert d.status()["sessions"]
        wait_until(lambda: drained(d), 10, "arena back to zero")


def test_a_readers_releases_reach_the_daemon_without_a_frame(tmp_path: object) -> None:
    with running_daemon(str(tmp_path), pool="64MiB", metrics=True) as d:
        with (
            SyncRelayClient("thinker", d.socket) as w,
            SyncRelayClient("talker", d.socket) as r,
        ):
            assert r._client._conn.session.release_ring is not None
            for i in range(40):
                _relayed(w, r, i, MiB, f"r{i}")
            assert not r._client._conn.session.pending.release  # none waits for a frame
            # Taken after the writer's frames, or on the daemon's timer: the
            # arena's leases are all back while both sessions stay open.
            wait_until(lambda: d.pool().get("used_bytes", 0) == 0, 10, "every lease freed")
            assert _released(d, "ring") == 40 and _released(d, "frame") == 0
        wait_until(lambda: drained(d), 10, "arena back to zero")


def _notices_sent(client: RelayClient) -> list[Any]:
    """The Claim and Release notices of every frame ``client`` sends, from now on."""
    channel = client._conn.session
    seen: list[Any] = []
    write = channel._write_bytes

    def write_bytes(data: bytes) -> None:
        frame = pb.SessionFrame.FromString(data[FRAME_LENGTH.size :])
        seen.extend([*frame.claim, *frame.release])
        write(data)

    channel._write_bytes = write_bytes
    return seen


def test_a_large_copy_claims_its_lease_in_the_ring_and_releases_it_there(
    tmp_path: object,
) -> None:
    """A copy of 8 MiB and up claims its lease first, so that the lease is freed at
    once if the reader dies copying; the Claim goes in the ring, waking nobody, and
    so does the Release after it, in that order."""
    with running_daemon(str(tmp_path), pool="128MiB", metrics=True) as d:
        with (
            SyncRelayClient("thinker", d.socket) as w,
            SyncRelayClient("talker", d.socket) as r,
        ):
            for i, size in enumerate((MiB, 9 * MiB, MiB)):
                _relayed(w, r, i, size, f"c{i}")
            wait_until(lambda: d.pool().get("used_bytes", 0) == 0, 10, "every lease freed")
            assert _released(d, "ring") == 3 and _released(d, "frame") == 0
            scrape = d.scrape()
            for reason in ("reader_died", "ttl"):
                assert metric(scrape, "relayd_leases_reclaimed_total", reason=reason) == 0
        wait_until(lambda: drained(d), 10, "arena back to zero")


def test_the_async_clients_large_copy_claims_in_the_ring_too(tmp_path: object) -> None:
    async def scenario(sock: str) -> list[Any]:
        async with RelayClient("thinker", sock) as w, RelayClient("talker", sock) as r:
            sent = _notices_sent(r)
            payload = make_payload(7, 9 * MiB)
            ref = await w.put(payload, to_stage="talker", request_id="big", timeout=30)
            assert digest(await r.get(ref)) == digest(payload)
            return sent

    with running_daemon(str(tmp_path), pool="128MiB", metrics=True) as d:
        sent = asyncio.run(asyncio.wait_for(scenario(d.socket), 60))
        assert sent == []  # no frame: the Claim and the Release went in the ring
        wait_until(lambda: _released(d, "ring") == 1, 10, "the release judged")
        assert _released(d, "frame") == 0
        wait_until(lambda: drained(d), 10, "arena back to zero")


def test_a_large_leases_run_is_reused_on_its_readers_mark_with_no_notice_sent(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large lease's notices linger as a small one's do: the writer's next put
    of the same size copies into the run its reader has just marked read, while
    it is still in cache, with no frame sent and no Freed come. The clients'
    linger is made a minute here, so nothing below comes from it; the leases
    are all freed once the clients close."""
    import relayd_client._notices

    monkeypatch.setattr(relayd_client._notices, "NOTICE_LINGER_S", 60.0)
    with running_daemon(str(tmp_path), pool="64MiB", metrics=True) as d:
        with (
            SyncRelayClient("thinker", d.socket) as w,
            SyncRelayClient("talker", d.socket) as r,
        ):
            slots = [_slot(_relayed(w, r, i, PROMPT_NOTICE_BYTES, f"p{i}")) for i in range(4)]
            assert slots == slots[:1] * 4
            assert _released(d, "frame") == 0
        wait_until(lambda: drained(d), 10, "arena back to zero")


def test_runs_taken_back_on_their_readers_marks_hold_no_lingering_frame(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer's lingering notices go at once when they hold NOTICE_LINGER_MAX_BYTES
    of its arena back, but not the bytes it took back itself on its readers'
    marks: a stop-and-wait writer of 4 MiB puts sends nothing for more than
    that (each frame is a wake-up of the daemon). The lingers of notices and of
    latency reports are made a minute."""
    import relayd_client._notices
    import relayd_client._reports

    monkeypatch.setattr(relayd_client._notices, "NOTICE_LINGER_S", 60.0)
    monkeypatch.setattr(relayd_client._reports, "REPORT_LINGER_S", 60.0)
    n = NOTICE_LINGER_MAX_BYTES // PROMPT_NOTICE_BYTES + 4
    with running_daemon(str(tmp_path), pool="64MiB", metrics=True) as d:
        with (
            SyncRelayClient("thinker", d.socket) as w,
            SyncRelayClient("talker", d.socket) as r,
        ):
            session = w._client._conn.session
            first = _slot(_relayed(w, r, 0, PROMPT_NOTICE_BYTES, "h0"))  # went: nothing lingered
            frame = session.pending
            slots = {_slot(_relayed(w, r, i, PROMPT_NOTICE_BYTES, f"h{i}")) for i in range(1, n)}
            assert slots == {first}  # each put into the run its reader had just marked
            assert session.pending is frame  # still the first frame: nothing went
            assert [x.publish.lease_id for x in frame.reserve] == [
                x.lease_id for x in frame.reserve
            ]
            assert len(frame.reserve) == n - 1
        wait_until(lambda: drained(d), 10, "arena back to zero")


def test_what_a_reader_released_before_it_died_is_freed_at_once(tmp_path: object) -> None:
    """A reader that ends without closing leaves its last Releases in its ring (a frame
    would still have lingered): the daemon frees them when the session goes, not at
    the lease TTL."""
    with running_daemon(str(tmp_path), "--lease-ttl", "600", pool="64MiB", metrics=True) as d:
        with SyncRelayClient("thinker", d.socket) as w:
            payloads = [make_payload(i, MiB) for i in range(5)]
            refs = [
                w.put(p, to_stage="talker", request_id=f"d{i}", timeout=30)
                for i, p in enumerate(payloads)
            ]
            lines = "".join(f"{ref.to_bytes().hex()}\n" for ref in refs) + "\n"
            cp = run_worker(["read-exit", "--socket", d.socket], input=lines.encode())
            assert cp.stdout.decode().split() == [digest(p) for p in payloads]
            wait_until(lambda: d.pool().get("used_bytes", 0) == 0, 10, "the reads' leases freed")
            assert _released(d, "ring") == 5
            scrape = d.scrape()
            for reason in ("reader_died", "ttl"):
                assert metric(scrape, "relayd_leases_reclaimed_total", reason=reason) == 0
        wait_until(lambda: drained(d), 10, "arena back to zero")
