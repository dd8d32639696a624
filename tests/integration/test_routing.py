"""Topology-aware routing with a real daemon: registry, Route, local_object, shm, socket, refs."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest
import torch
from relayd_client import RelayClient, Transport

from tests._daemon import (
    Daemon,
    async_wait_until,
    isolated_worker,
    read_line,
    run_worker,
    running_daemon,
    spawn_worker,
    unshare_available,
    wait_until,
)
from tests._daemon import drained as _drained
from tests._daemon import lines as _lines
from tests._daemon import metric as _metric
from tests._workers import digest, make_payload

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20


def _edges(d: Daemon) -> dict[tuple[str, str], dict[str, Any]]:
    return {(e["from_stage"], e["to_stage"]): e for e in d.status().get("edges", [])}


def _published(d: Daemon) -> int:
    return int(d.status()["leases_by_state"].get("published", "0"))


def test_two_stages_in_one_process_exchange_the_object_itself(tmp_path: object) -> None:
    async def scenario(d: Daemon) -> None:
        async with (
            RelayClient("thinker", d.socket) as a,
            RelayClient("talker", d.socket) as b,
            RelayClient("vocoder", d.socket) as c,
        ):
            payload = make_payload(1, MiB)
            ref = await a.put(payload, to_stage="talker", request_id="r")
            assert ref.transport is Transport.LOCAL_OBJECT
            assert _published(d) == 0 and d.pool()["used_bytes"] == 0  # no lease at all
            got = await b.get(ref.to_bytes())
            assert got is payload

            # fan-out: every target gets its own containers, the tensors are shared
            r1 = await a.put(payload, to_stage="talker", request_id="f")
            r2 = await a.put(payload, to_stage="vocoder", request_id="f")
            g1, g2 = await b.get(r1), await c.get(r2)
            assert g1 is payload and g2 is not payload and g2["extras"] is not payload["extras"]
            assert g2["hidden"] is payload["hidden"]
            assert digest(g2) == digest(payload)

            edge = _edges(d)[("thinker", "talker")]
            assert edge["transport"] == "TRANSPORT_LOCAL_OBJECT"
            assert edge["reason"] == "same process"

    with running_daemon(str(tmp_path), metrics=True) as d:
        asyncio.run(asyncio.wait_for(scenario(d), 60))
        wait_until(
            lambda: _metric(d.scrape(), "relayd_transfers_total", transport="local_object") == 3,
            10,
            "local_object transfers reported",
        )
        assert _metric(d.scrape(), "relayd_transfer_bytes_total", transport="local_object") > MiB


def test_route_cache_follows_the_registry(tmp_path: object) -> None:
    async def scenario(d: Daemon) -> None:
        async with RelayClient("w", d.socket) as w:
            first = await w.put({"x": torch.ones(MiB)}, to_stage="z", request_id="a")
            assert first.transport is Transport.SHM
            assert "reader unknown" in _edges(d)[("w", "z")]["reason"]
            version = w.registry_version
            async with RelayClient("z", d.socket) as z:
                # the daemon pushes the new registry version; the cached route goes
                await async_wait_until(lambda: w.registry_version > version, 10, "a new registry")
                second = await w.put({"x": torch.ones(MiB)}, to_stage="z", request_id="a")
                assert second.transport is Transport.LOCAL_OBJECT
                assert torch.equal((await z.get(first))["x"], torch.ones(MiB))
                assert (await z.get(second))["x"].numel() == MiB
            # z's session ended: the registry forgets it (the daemon sees EOF)
            wait_until(
                lambda: [s["stage"] for s in d.status()["stages"]] == ["w"], 10, "z unregistered"
            )
            assert int(d.status()["registry_version"]) >= 3

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d), 60))
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def test_two_processes_use_shm_and_status_shows_the_registry(tmp_path: object) -> None:
    with running_daemon(str(tmp_path), metrics=True) as d:
        reader = spawn_worker(["read", "--socket", d.socket])
        assert reader.stdout is not None and reader.stdin is not None
        assert reader.stdout.readline().strip() == b"READY"
        writer = spawn_worker(["write", "--socket", d.socket, "--hold", "--sizes", str(2 * MiB)])
        assert writer.stdout is not None
        line = writer.stdout.readline().decode()
        assert line.split()[2] == "shm"
        assert writer.stdout.readline().strip() == b"HOLDING"
        st = d.status()
        stages = {s["stage"]: s for s in st["stages"]}
        assert set(stages) == {"thinker", "talker"}
        assert all(s["can_map_shm"] for s in stages.values())
        assert {s["pid"] for s in stages.values()} == {writer.pid, reader.pid}
        assert stages["thinker"]["process_key"] != stages["talker"]["process_key"]
        edge = _edges(d)[("thinker", "talker")]
        assert edge["transport"] == "TRANSPORT_SHM"
        assert {s["data_path"] for s in st["sessions"]} == {"shm"}
        text = subprocess.run(
            [sys.executable, "-m", "relayd", "status", "--socket", d.socket],
            capture_output=True,
            timeout=60,
            check=True,
        ).stdout.decode()
        assert "STAGES" in text and "EDGES" in text and "thinker -> talker" in text
        reader.stdin.write(line.encode() + b"\n")
        reader.stdin.close()
        assert reader.stdout.readline().decode().strip() == line.split()[1]
        assert reader.wait(timeout=30) == 0
        wait_until(lambda: d.pool()["used_bytes"] == 0, 10, "lease released")
        assert _metric(d.scrape(), "relayd_transfers_total", transport="shm") == 1


@pytest.mark.skipif(not unshare_available(), reason="needs root and unshare --mount")
def test_client_without_the_daemons_shm_falls_back_to_the_socket(tmp_path: object) -> None:
    with running_daemon(str(tmp_path), metrics=True) as d:
        # writer cannot map the arena: the daemon writes its bytes into a lease
        writer = isolated_worker(
            ["write", "--socket", d.socket, "--hold", "--sizes", f"{3 * MiB + 5}"]
        )
        assert writer.stdout is not None
        line = writer.stdout.readline().decode()
        assert line.split()[2:] == ["socket"], (line, writer.stderr)
        assert writer.stdout.readline().strip() == b"HOLDING"
        st = d.status()
        assert [s["data_path"] for s in st["sessions"]] == ["socket"]
        assert [s["can_map_shm"] for s in st["stages"]] == [False]
        text = subprocess.run(
            [sys.executable, "-m", "relayd", "status", "--socket", d.socket],
            capture_output=True,
            timeout=60,
            check=True,
        ).stdout.decode()
        assert "socket" in text
        # an SHM reader reads it like any lease
        r = run_worker(["read", "--socket", d.socket], input=line.encode() + b"\n")
        assert _lines(r)[1] == line.split()[1]
        writer.kill()
        writer.wait(timeout=30)

        # reader cannot map the arena: the daemon copies the lease out to it
        w = _lines(run_worker(["write", "--socket", d.socket, "--sizes", str(2 * MiB)]))
        reader = isolated_worker(["read", "--socket", d.socket])
        out, err = reader.communicate(w[0].encode() + b"\n\n", timeout=60)
        assert reader.returncode == 0, err.decode()[-2000:]
        assert out.decode().splitlines()[1] == w[0].split()[1]

        wait_until(lambda: _drained(d), 10, "arena back to zero")
        text = d.scrape()
        # Each transfer counted once, under its DataRef's transport: the socket
        # writer's put, and the shm put (its reader had not attached yet).
        assert _metric(text, "relayd_transfers_total", transport="socket") == 1
        assert _metric(text, "relayd_transfers_total", transport="shm") == 1
        assert _metric(text, "relayd_transfer_bytes_total", transport="socket") >= 3 * MiB
        assert _metric(text, "relayd_socket_fallback_sessions_total") == 2


@pytest.mark.skipif(not unshare_available(), reason="needs root and unshare --mount")
def test_a_socket_reader_gets_a_busy_writers_puts_without_waiting_out_their_linger(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that cannot map the arena reads through the daemon, so the writer's
    Publish is what it reads by: that one goes at once. Every other notice of this
    writer would linger a minute here, past the daemon's wait for a late Publish."""
    import relayd_client._notices

    monkeypatch.setattr(relayd_client._notices, "NOTICE_LINGER_S", 60.0)
    with running_daemon(str(tmp_path)) as d:
        reader = isolated_worker(["read", "--socket", d.socket])
        assert read_line(reader, 60) == "READY"
        payloads = [make_payload(i, 256 << 10) for i in range(3)]

        async def scenario() -> list[str]:
            async with RelayClient("thinker", d.socket) as w:
                got = []
                for i, payload in enumerate(payloads):  # after the first, the channel is busy
                    ref = await w.put(payload, to_stage="talker", request_id=f"s{i}")
                    assert ref.transport is Transport.SOCKET
                    assert not w._conn.session._dirty, "the Publish lingers"
                    assert reader.stdin is not None
                    reader.stdin.write(ref.to_bytes().hex().encode() + b"\n")
                    reader.stdin.flush()
                    got.append(await asyncio.to_thread(read_line, reader, 30))
                return got

        assert asyncio.run(asyncio.wait_for(scenario(), 120)) == [digest(p) for p in payloads]
        assert reader.stdin is not None
        reader.stdin.close()
        assert reader.wait(timeout=30) == 0
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def test_three_stage_chain_forwards_a_tensor_without_copying_it(tmp_path: object) -> None:
    size = 16 * MiB

    def chain(d: Daemon, request: str) -> tuple[str, str]:
        a = _lines(
            run_worker(
                ["ref-write", "--socket", d.socket, "--stage", "A", "--to", "B", "--consumer",
                 "C", "--request", request, "--sizes", str(size), "--seed", "3"]
            )
        )[0].split()  # fmt: skip
        assert a[2] == "inline"  # the payload A sends B is a small reference
        leases = d.status()["leases"]
        assert [(x["to_stage"], int(x["bytes"])) for x in leases] == [("C", size)]
        b = _lines(
            run_worker(
                ["forward", "--socket", d.socket, "--stage", "B", "--to", "C", "--request",
                 request], input=(" ".join(a) + "\n\n").encode()
            )
        )[0].split()  # fmt: skip
        assert b[1:] == ["TensorRef", "inline"]
        # B read none of its bytes: the lease was never claimed, still waits for C
        leases = d.status()["leases"]
        assert [x["state"] for x in leases] == ["LEASE_STATE_PUBLISHED"]
        return a[1], b[0]

    async def abort(sock: str, request: str) -> int:
        async with RelayClient("C", sock) as c:
            return await c.abort(request)

    with running_daemon(str(tmp_path), metrics=True) as d:
        big_digest, to_c = chain(d, "r1")
        g = torch.Generator().manual_seed(3)
        big = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
        assert digest(big) == big_digest
        c = _lines(run_worker(["read", "--socket", d.socket, "--stage", "C"], input=to_c.encode()))
        assert c[1] == digest({"step": 2, "big": big})
        wait_until(lambda: _drained(d), 10, "the forwarded tensor freed once C read it")
        text = d.scrape()
        assert _metric(text, "relayd_refs_total") == 1
        assert _metric(text, "relayd_ref_bytes_total") == size
        assert _metric(text, "relayd_inline_tensor_bytes_total") == 0

        _, to_c = chain(d, "r2")
        assert asyncio.run(asyncio.wait_for(abort(d.socket, "r2"), 30)) == 1
        wait_until(lambda: _drained(d), 10, "abort freed the unconsumed ref")
        c = _lines(run_worker(["read", "--socket", d.socket, "--stage", "C"], input=to_c.encode()))
        assert c[1].split()[:2] in (["ERR", "StaleRefError"], ["ERR", "AbortedError"])


def test_metrics_count_every_transport_clients_report(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    import relayd_client._local

    async def scenario(sock: str) -> None:
        async with RelayClient("a", sock) as a, RelayClient("b", sock) as b:
            # As if "b" were served by another process: a small put goes inline.
            with monkeypatch.context() as m:
                m.setattr(relayd_client._local, "serves", lambda stage: False)
                small = await a.put({"t": torch.arange(10)}, to_stage="b", request_id="m")
            assert small.transport is Transport.INLINE
            await b.get(small)
            local = await a.put({"t": torch.zeros(MiB, dtype=torch.uint8)}, to_stage="b",
                                request_id="m")  # fmt: skip
            assert local.transport is Transport.LOCAL_OBJECT
            await b.get(local)

    with running_daemon(str(tmp_path), metrics=True) as d:
        asyncio.run(asyncio.wait_for(scenario(d.socket), 60))
        refs = _lines(run_worker(["write", "--socket", d.socket, "--sizes", str(MiB)]))
        run_worker(["read", "--socket", d.socket], input=refs[0].encode() + b"\n")

        def counted() -> bool:
            t = d.scrape()
            return all(
                _metric(t, "relayd_transfers_total", transport=x) == 1
                for x in ("inline", "local_object", "shm")
            )

        wait_until(counted, 10, "inline, local_object and shm counted")
        text = d.scrape()
        assert _metric(text, "relayd_transfer_bytes_total", transport="inline") == 80
        assert _metric(text, "relayd_inline_tensor_bytes_total") == 80
        assert _metric(text, "relayd_transfer_bytes_total", transport="local_object") == MiB
        st = d.status()["transfers_by_transport"]
        assert {k: int(v) for k, v in st.items()} == {"inline": 1, "local_object": 1, "shm": 1}


def test_a_small_same_process_put_is_handed_over_by_reference(tmp_path: object) -> None:
    """local_object comes before inline: 4 KiB between two stages of one process
    is the writer's own object, not bytes encoded into the DataRef and decoded."""
    from relayd_client import SyncRelayClient

    payload = {"t": torch.arange(1024, dtype=torch.int32), "step": 7}  # 4 KiB of tensor

    async def scenario(sock: str) -> None:
        async with RelayClient("a", sock) as a, RelayClient("b", sock) as b:
            ref = await a.put(payload, to_stage="b", request_id="small")
            assert ref.transport is Transport.LOCAL_OBJECT
            got = await b.get(ref)
            assert got is payload and got["t"].data_ptr() == payload["t"].data_ptr()

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d.socket), 60))
        with SyncRelayClient("c", d.socket) as c, SyncRelayClient("e", d.socket) as e:
            ref = c.put(payload, to_stage="e", request_id="small-sync")
            assert ref.transport is Transport.LOCAL_OBJECT
            got = e.get(ref)
            assert got is payload and got["t"].data_ptr() == payload["t"].data_ptr()
        wait_until(lambda: _drained(d), 10, "nothing leased")
