"""The daemon as a subprocess, writers and readers in other processes, real /dev/shm."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import signal
import subprocess
import sys

import pytest
import torch
from relayd_client import (
    AbortedError,
    CorruptRefError,
    DataRef,
    PermissionDeniedError,
    RelayClient,
    ResourceExhaustedError,
    StaleEpochError,
    StaleRefError,
    Transport,
)

from tests._daemon import Daemon, kill9, run_worker, running_daemon, spawn_worker, wait_until
from tests._daemon import drained as _drained
from tests._daemon import lines as _lines
from tests._daemon import metric as _metric
from tests._fixtures import separate_processes
from tests._workers import digest, make_payload

__all__ = ["separate_processes"]  # the autouse fixture: clients here use the arena

pytestmark = pytest.mark.timeout(180)


MiB = 1 << 20


def test_round_trip_nested_payloads_0_to_64mib(tmp_path: object) -> None:
    sizes = [0, 1, 100, 12_000, 20_000, MiB, 4 * MiB + 3, 64 * MiB]
    with running_daemon(str(tmp_path), pool="160MiB") as d:
        w = run_worker(
            ["write", "--socket", d.socket, "--split", "--sizes", ",".join(map(str, sizes))]
        )
        refs = _lines(w)
        assert len(refs) == len(sizes)
        transports = [line.split()[2] for line in refs]
        assert transports[:4] == ["inline"] * 4 and transports[4:] == ["shm"] * 4
        r = run_worker(["read", "--socket", d.socket], input="\n".join(refs).encode() + b"\n\n")
        got = _lines(r)[1:]
        assert got == [line.split()[1] for line in refs]
        wait_until(lambda: _drained(d), 10, "arena back to zero")
        st = d.status()
        assert st["transfers_by_transport"]["shm"] == "4"


def test_repeated_payload_structures_each_arrive_as_sent(tmp_path: object) -> None:
    # A writer remembers what it derives from a payload's structure (layout,
    # DataRef fields): payloads that differ only in shape, dtype or
    # destination must each still arrive exactly as sent, with their own ids.
    f32 = torch.arange(4096, dtype=torch.float32)
    payloads = [
        ("talker", {"h": f32}),
        ("talker", {"h": torch.arange(8192, dtype=torch.float32)}),  # same header, other shape
        ("talker", {"h": f32.double()}),  # other dtype
        ("talker", {"h": f32.reshape(64, 64)}),  # same bytes, other shape
        ("critic", {"h": f32}),  # other stage
        ("talker", {"h": torch.arange(100_000, dtype=torch.float32)}),  # over the arena
        ("talker", {"h": torch.arange(100_000, dtype=torch.int32)}),
        ("talker", {"g": torch.arange(100_000, dtype=torch.int32)}),  # other header
    ]

    async def scenario(socket: str) -> set[str]:
        object_ids = set()
        async with (
            RelayClient("thinker", socket) as w,
            RelayClient(["talker", "critic"], socket) as r,
        ):
            for rnd in range(3):
                for i, (stage, payload) in enumerate(payloads):
                    ref = await w.put(payload, to_stage=stage, request_id=f"r{rnd}-{i}")
                    ref = DataRef.from_bytes(ref.to_bytes())
                    assert (ref.request_id, ref.to_stage, ref.chunk_id) == (
                        f"r{rnd}-{i}",
                        stage,
                        None,
                    )
                    object_ids.add(ref.object_id)
                    assert digest(await r.get(ref)) == digest(payload)
        return object_ids

    with running_daemon(str(tmp_path)) as d:
        assert len(asyncio.run(asyncio.wait_for(scenario(d.socket), 60))) == 3 * len(payloads)
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def test_publishes_carried_in_reserves_and_sent_on_their_own_both_count(
    tmp_path: object,
) -> None:
    # The daemon says at Attach that it takes a Publish inside its Reserve;
    # a writer that sends Publishes on their own (as to an older daemon) works
    # the same. A carried Publish the daemon dropped would leave its lease
    # unpublished while the writer lives: not counted, its bytes not freed.
    payload = {"h": torch.arange(100_000, dtype=torch.float32)}

    def published_and_freed(d: Daemon, n: int) -> bool:
        shm = d.status()["transfers_by_transport"].get("shm")
        return shm == str(n) and d.pool().get("used_bytes", 0) == 0

    async def scenario(d: Daemon) -> None:
        async with RelayClient("thinker", d.socket) as w, RelayClient("talker", d.socket) as r:
            assert w._conn.session.reserve_publishes
            for n, carried in enumerate((True, False), 1):
                w._conn.session.reserve_publishes = carried
                for i in range(20):
                    ref = await w.put(payload, to_stage="talker", request_id=f"{carried}-{i}")
                    got = await r.get(DataRef.from_bytes(ref.to_bytes()))
                    assert digest(got) == digest(payload)
                w._conn.flush()  # the last Publishes linger otherwise
                done = functools.partial(published_and_freed, d, 20 * n)
                await asyncio.to_thread(wait_until, done, 10, f"{20 * n} counted")

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d), 60))
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def test_thousand_concurrent_transfers_leave_arena_empty(tmp_path: object) -> None:
    with running_daemon(str(tmp_path), pool="64MiB") as d:
        writer = spawn_worker(
            [
                "write",
                "--socket",
                d.socket,
                "--split",
                "--concurrent",
                "--count",
                "1000",
                "--sizes",
                f"512,65536,262144,{MiB}",
                # All 1000 wait on one reader: on a loaded 2-core box the
                # backlog, not a fault, can outlast the 10 s default.
                "--timeout",
                "90",
            ]
        )
        reader = spawn_worker(["read", "--socket", d.socket, "--stage", "talker", "--concurrent"])
        assert reader.stdout is not None and reader.stdin is not None and writer.stdout is not None
        assert reader.stdout.readline().strip() == b"READY"
        # Drain the reader's output concurrently, or both pipes fill and deadlock.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            output = pool.submit(reader.stdout.read)
            expected = []
            for line in writer.stdout:
                expected.append(line.split()[1].decode())
                reader.stdin.write(line)
                reader.stdin.flush()
            assert writer.wait(timeout=120) == 0
            reader.stdin.write(b"\n")
            reader.stdin.close()
            got = output.result(timeout=120).decode().split()
        assert reader.wait(timeout=60) == 0
        assert len(expected) == 1000
        assert sorted(got) == sorted(expected)
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def test_killed_writer_loses_reservation_and_killed_reader_frees_claim(tmp_path: object) -> None:
    with running_daemon(str(tmp_path), metrics=True) as d:
        holder = spawn_worker(["hold-reserved", "--socket", d.socket, "--sizes", str(MiB)])
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == b"RESERVED"
        wait_until(
            lambda: d.status()["leases_by_state"].get("reserved") == "1", 10, "reserved lease"
        )
        kill9(holder)
        wait_until(lambda: _drained(d), 10, "reservation reclaimed")
        assert _metric(d.scrape(), "relayd_leases_reclaimed_total", reason="writer_died") == 1

        refs = _lines(run_worker(["write", "--socket", d.socket, "--sizes", str(2 * MiB)]))
        claimer = spawn_worker(["hold-claimed", "--socket", d.socket, "--stage", "talker"])
        assert claimer.stdin is not None and claimer.stdout is not None
        claimer.stdin.write(refs[0].encode() + b"\n")
        claimer.stdin.flush()
        line = claimer.stdout.readline().decode().split()
        assert line == ["CLAIMED", refs[0].split()[1]]
        wait_until(lambda: d.status()["leases_by_state"].get("claimed") == "1", 10, "claimed lease")
        kill9(claimer)
        wait_until(lambda: _drained(d), 10, "claim reclaimed")
        assert _metric(d.scrape(), "relayd_leases_reclaimed_total", reason="reader_died") == 1


def test_published_payload_outlives_its_killed_writer(tmp_path: object) -> None:
    with running_daemon(str(tmp_path)) as d:
        writer = spawn_worker(["write", "--socket", d.socket, "--hold", "--sizes", str(3 * MiB)])
        assert writer.stdout is not None
        ref = writer.stdout.readline().decode()
        assert writer.stdout.readline().strip() == b"HOLDING"
        kill9(writer)
        r = run_worker(["read", "--socket", d.socket], input=ref.encode() + b"\n")
        assert _lines(r)[1] == ref.split()[1]
        wait_until(lambda: _drained(d), 10, "orphaned lease freed after read")


def test_abort_frees_request_only_for_its_stages(tmp_path: object) -> None:
    async def scenario(sock: str, d: Daemon) -> None:
        async with (
            RelayClient("thinker", sock) as w,
            RelayClient("talker", sock) as r,
            RelayClient("bystander", sock) as b,
        ):
            refs = [
                await w.put(make_payload(i, MiB), to_stage="talker", request_id="req")
                for i in range(3)
            ]
            other = await w.put(make_payload(9, MiB), to_stage="talker", request_id="keep")
            # Inline: never in the daemon, so only the reader's own abort can stop it.
            small = await w.put({"x": torch.ones(4)}, to_stage="talker", request_id="req")
            assert small.transport is Transport.INLINE
            with pytest.raises(PermissionDeniedError):
                await b.abort("req")
            assert d.status()["leases_by_state"]["published"] == "4"
            assert await r.abort("req") == 3
            assert await r.abort("req") == 0  # idempotent
            assert d.status()["leases_by_state"]["published"] == "1"
            with pytest.raises(AbortedError):
                await r.get(refs[0])
            with pytest.raises(AbortedError):
                await r.get(small)
            with pytest.raises(AbortedError):
                await w.put(make_payload(1, MiB), to_stage="talker", request_id="req")
            assert digest(await r.get(other)) == digest(make_payload(9, MiB))

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d.socket, d), 60))
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def test_an_abort_ahead_of_the_writes_is_idempotent_and_no_bystander_locks_it(
    tmp_path: object,
) -> None:
    """Aborting a request nobody wrote yet leaves a tombstone. Aborting it again
    (a cleanup path after a timeout handler) is no error, and a bystander's
    tombstone does not keep the request's own stages from aborting it."""

    async def scenario(sock: str) -> None:
        async with (
            RelayClient("thinker", sock) as w,
            RelayClient("talker", sock) as r,
            RelayClient("bystander", sock) as b,
        ):
            assert await w.abort("early") == 0
            assert await w.abort("early") == 0
            assert await b.abort("taken") == 0
            assert await r.abort("taken") == 0
            # The tombstone now binds the talker's leases: a writer process that
            # did not hear of the abort puts anyway, and the daemon frees it.
            async with RelayClient("thinker", sock) as w2:
                ref = await w2.put(make_payload(1, MiB), to_stage="talker", request_id="taken")
                with pytest.raises((AbortedError, StaleRefError)):
                    await r.get(ref)
            # Once its own stages wrote it, a bystander still may not abort it.
            await w.put(make_payload(2, MiB), to_stage="talker", request_id="mine")
            with pytest.raises(PermissionDeniedError):
                await b.abort("mine")
            assert await w.abort("mine") == 1

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d.socket), 60))
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def test_full_arena_gives_resource_exhausted_then_recovers(tmp_path: object) -> None:
    async def scenario(sock: str) -> None:
        async with RelayClient("thinker", sock) as w, RelayClient("talker", sock) as r:
            refs = []
            with pytest.raises(ResourceExhaustedError):
                for i in range(100):
                    refs.append(
                        await w.put(
                            make_payload(i, 3 * MiB),
                            to_stage="talker",
                            request_id=f"r{i}",
                            timeout=0.5,
                        )
                    )
            assert 2 <= len(refs) < 100
            waiting = asyncio.ensure_future(
                w.put(make_payload(99, 3 * MiB), to_stage="talker", request_id="late", timeout=20)
            )
            await asyncio.sleep(0)
            assert digest(await r.get(refs[0])) == digest(make_payload(0, 3 * MiB))
            late = await asyncio.wait_for(waiting, 20)
            for ref in [*refs[1:], late]:
                await r.get(ref)

    with running_daemon(str(tmp_path), "--grant-size", "1MiB", pool="16MiB", metrics=True) as d:
        asyncio.run(asyncio.wait_for(scenario(d.socket), 60))
        wait_until(lambda: _drained(d), 10, "arena back to zero")
        assert _metric(d.scrape(), "relayd_reserve_wait_seconds_count") >= 1


def test_a_put_beyond_the_stage_quota_fails_at_once_and_alone(tmp_path: object) -> None:
    """No wait can make room for more than the quota: the put fails now, not at its deadline.

    A smaller put that waited on the same Grant call is not failed with it.
    """

    async def scenario(sock: str) -> None:
        async with RelayClient("thinker", sock, timeout=120) as w:
            big = asyncio.ensure_future(
                w.put(make_payload(0, 9 * MiB), to_stage="talker", request_id="big")
            )
            await asyncio.sleep(0)  # the big put's Grant call is in flight first
            small = asyncio.ensure_future(
                w.put(make_payload(1, 1 * MiB), to_stage="talker", request_id="small")
            )
            # Far below the 120 s deadline both puts would otherwise wait for.
            done = await asyncio.wait_for(asyncio.gather(big, small, return_exceptions=True), 30)
            assert isinstance(done[0], ResourceExhaustedError), done[0]
            assert "quota" in str(done[0])
            assert isinstance(done[1], DataRef), done[1]
            async with RelayClient("talker", sock) as r:
                assert digest(await r.get(done[1])) == digest(make_payload(1, 1 * MiB))

    with running_daemon(str(tmp_path), pool="16MiB") as d:  # quota: half the arena
        asyncio.run(asyncio.wait_for(scenario(d.socket), 60))
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def test_a_writer_short_of_space_gets_the_releases_readers_hold_back(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Releases linger to share frames, but not while a writer waits for their space.

    The readers' linger is made a minute here: only the daemon's reclaim,
    sent when the writer's Grant has to wait, can bring the releases in time.
    """
    import relayd_client._notices
    import relayd_client._session

    monkeypatch.setattr(relayd_client._notices, "NOTICE_LINGER_S", 60.0)
    monkeypatch.setattr(relayd_client._session, "NOTICE_LINGER_MAX_BYTES", 1 << 40)

    async def scenario(sock: str) -> None:
        async with RelayClient("thinker", sock, timeout=30) as w, RelayClient("talker", sock) as r:
            for i in range(12):  # 12 MiB through an 8 MiB stage quota
                ref = await w.put(make_payload(i, MiB), to_stage="talker", request_id=f"q{i}")
                assert digest(await r.get(ref)) == digest(make_payload(i, MiB))
            await r.get(await w.put(make_payload(99, MiB), to_stage="talker", request_id="x"))
            r._conn.session.flush()  # the last release would linger past the check below

    with running_daemon(str(tmp_path), "--grant-size", "1MiB", pool="16MiB") as d:
        asyncio.run(asyncio.wait_for(scenario(d.socket), 25))
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def test_stale_corrupt_and_old_epoch_refs_are_refused(tmp_path: object) -> None:
    async def first(sock: str) -> tuple[bytes, bytes]:
        async with RelayClient("thinker", sock) as w, RelayClient("talker", sock) as r:
            ref = await w.put({"x": torch.arange(300_000)}, to_stage="talker", request_id="a")
            wire = ref.to_bytes()
            assert ref.transport is Transport.SHM
            bad = bytearray(wire)
            bad[len(bad) // 2] ^= 0x40
            with pytest.raises(CorruptRefError):
                DataRef.from_bytes(bytes(bad))
            with pytest.raises(CorruptRefError):
                DataRef.from_bytes(wire[:-3])
            assert torch.equal((await r.get(ref))["x"], torch.arange(300_000))
            with pytest.raises(StaleRefError):
                await r.get(ref)
            unread = await w.put({"x": torch.ones(100_000)}, to_stage="talker", request_id="b")
            return wire, unread.to_bytes()

    async def second(sock: str, wire: bytes) -> None:
        async with RelayClient("talker", sock) as r:
            with pytest.raises(StaleEpochError):
                await r.get(DataRef.from_bytes(wire))

    d = Daemon(str(tmp_path)).start()
    _, unread = asyncio.run(asyncio.wait_for(first(d.socket), 60))
    kill9(d.proc)  # type: ignore[arg-type]
    left = d.segments()
    assert left, "a SIGKILLed daemon leaves its segments behind"
    d2 = Daemon(str(tmp_path)).start()
    try:
        assert not set(left) & set(d2.segments()), "stale segments were not removed at start"
        asyncio.run(asyncio.wait_for(second(d2.socket, unread), 60))
    finally:
        assert d2.stop() == 0
    assert d2.segments() == []


def test_sigterm_drains_and_unlinks_everything(tmp_path: object) -> None:
    d = Daemon(str(tmp_path)).start()
    refs = _lines(run_worker(["write", "--socket", d.socket, "--split", "--sizes", f"{MiB},{MiB}"]))
    assert len(d.segments()) >= 2
    reader = spawn_worker(["read", "--socket", d.socket])
    assert reader.stdout is not None and reader.stdin is not None
    assert reader.stdout.readline().strip() == b"READY"
    d.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    # The drain waits for published leases: the reader can still take them.
    reader.stdin.write(("\n".join(refs) + "\n\n").encode())
    reader.stdin.flush()
    assert reader.stdout.read().decode().split() == [r.split()[1] for r in refs]
    reader.wait(timeout=30)
    assert d.proc.wait(timeout=30) == 0  # type: ignore[union-attr]
    assert d.segments() == []
    assert not os.path.exists(d.socket)


def test_second_daemon_on_same_socket_refuses(tmp_path: object) -> None:
    with running_daemon(str(tmp_path)) as d:
        cp = subprocess.run(
            [
                sys.executable,
                "-m",
                "relayd",
                "serve",
                "--socket",
                d.socket,
                "--shm-pool-size",
                "64MiB",
            ],
            capture_output=True,
            timeout=60,
        )
        assert cp.returncode == 2
        assert b"another relayd" in cp.stderr and str(d.pid).encode() in cp.stderr
        assert d.status()["state"] == "DAEMON_STATE_SERVING"


def test_metrics_endpoint_reports_pools_sessions_and_transfers(tmp_path: object) -> None:
    with running_daemon(str(tmp_path), metrics=True, pool="64MiB") as d:
        refs = _lines(
            run_worker(["write", "--socket", d.socket, "--split", "--sizes", f"{MiB},100"])
        )
        text = d.scrape()
        assert _metric(text, "relayd_pool_capacity_bytes", pool="shm") >= 60 * MiB
        # 1 MiB plus the payload's small extra tensors: 17 slots of 64 KiB
        assert _metric(text, "relayd_pool_used_bytes", pool="shm") == 17 * 65536
        assert _metric(text, "relayd_leases", pool="shm", state="published") == 1
        assert _metric(text, "relayd_transfers_total", transport="shm") == 1
        assert _metric(text, "relayd_transfer_bytes_total", transport="shm") >= MiB
        assert _metric(text, "relayd_transfers_total", transport="inline") == 1
        # Collector pauses, per generation, from the daemon's own callback.
        for generation in "012":
            count = _metric(text, "relayd_gc_pause_seconds_count", generation=generation)
            top = _metric(text, "relayd_gc_pause_seconds_bucket", generation=generation, le="+Inf")
            assert f'relayd_gc_pause_seconds_count{{generation="{generation}"}}' in text
            assert count == top
        # What the daemon built at startup is frozen: no full collection walks it.
        assert _metric(text, "relayd_gc_frozen_objects") > 10_000
        run_worker(["read", "--socket", d.socket], input=refs[0].encode() + b"\n")
        wait_until(
            lambda: _metric(d.scrape(), "relayd_pool_used_bytes", pool="shm") == 0,
            10,
            "used bytes back to zero",
        )
        assert _metric(d.scrape(), "relayd_sessions") == 0
