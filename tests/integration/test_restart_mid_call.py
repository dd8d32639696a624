"""A daemon restart in the middle of a call: the call fails clearly.

A put whose copy was under way when the daemon died must not seal its lease
into the new daemon's arena nor hand out a DataRef for it; a call waiting for
a re-attach that ``close()`` ends must fail as a closed client's call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch
from relayd_client import (
    DaemonUnavailableError,
    DataRef,
    RelayClient,
    SessionClosedError,
    SyncRelayClient,
)
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.shm import SHM_POOL
from relayd_client.wire.transport import Transport

from tests._daemon import Daemon, async_wait_until, kill9, restarted, wait_until
from tests._fixtures import separate_processes

__all__ = ["separate_processes"]  # the autouse fixture: leases, as between processes

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20


class _HeldCopy:
    """Wraps a copy function of ``relayd_client._copies`` so that the first call
    waits until the test lets it go."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        import relayd_client._copies as copies

        self.entered = threading.Event()
        self.go = threading.Event()
        real = getattr(copies, name)

        def held(*args: Any, **kw: Any) -> Any:
            if not self.entered.is_set():
                self.entered.set()
                assert self.go.wait(60), "the test never let the copy go"
            return real(*args, **kw)

        monkeypatch.setattr(copies, name, held)


def _held_call(
    monkeypatch: pytest.MonkeyPatch, obj: object, name: str
) -> tuple[Any, asyncio.Event, asyncio.Event]:
    """Make the coroutine method ``obj.name`` wait, once called, until the test sets
    ``go``: (the real method, ``asked``, set when it is called, ``go``)."""
    asked, go = asyncio.Event(), asyncio.Event()
    real = getattr(obj, name)

    async def held(*args: Any) -> Any:
        asked.set()
        await asyncio.wait_for(go.wait(), 60)
        return await real(*args)

    monkeypatch.setattr(obj, name, held)
    return real, asked, go


def test_a_large_put_whose_copy_spans_a_restart_fails(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = Daemon(str(tmp_path)).start()
    held = _HeldCopy(monkeypatch, "run_copies")  # a put of 8 MiB or more copies on a worker
    payload = {"x": torch.arange(4 * MiB, dtype=torch.int32)}  # 16 MiB

    async def scenario() -> None:
        nonlocal d
        async with RelayClient("thinker", d.socket, timeout=20) as w:
            put = asyncio.create_task(w.put(payload, to_stage="talker", request_id="r"))
            assert await asyncio.to_thread(held.entered.wait, 30)
            d = await asyncio.to_thread(restarted, d, str(tmp_path))
            await w.status()  # re-attached to the new daemon
            session = w.session_id
            held.go.set()
            with pytest.raises(DaemonUnavailableError):
                await asyncio.wait_for(put, 30)
            # The new session was left alone: no slot header of its arena
            # written, no Publish for a lease it never heard of.
            ref = await w.put({"y": torch.ones(4)}, to_stage="talker", request_id="s")
            assert ref.fields.origin.daemon_epoch == d.epoch
            assert w.session_id == session
            assert "bad publish" not in d.log()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        held.go.set()
        d.stop()


def test_a_blocking_put_whose_copy_spans_a_restart_fails(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = Daemon(str(tmp_path)).start()
    held = _HeldCopy(monkeypatch, "pack_at")  # the blocking put copies on its caller's thread
    try:
        with (
            SyncRelayClient("thinker", d.socket, timeout=20) as w,
            concurrent.futures.ThreadPoolExecutor(1) as pool,
        ):
            put = pool.submit(w.put, {"x": torch.ones(MiB)}, to_stage="talker", request_id="r")
            assert held.entered.wait(30)
            d = restarted(d, str(tmp_path))
            w.status()  # re-attached to the new daemon
            session = w.session_id
            held.go.set()
            with pytest.raises(DaemonUnavailableError):
                put.result(30)
            ref = w.put({"y": torch.ones(4)}, to_stage="talker", request_id="s")
            assert ref.fields.origin.daemon_epoch == d.epoch
            assert w.session_id == session
            assert "bad publish" not in d.log()
    finally:
        held.go.set()
        d.stop()


def test_a_put_planned_before_a_restart_and_leased_after_it_fails(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its DataRef would bear the old daemon's epoch over the new daemon's lease:
    every reader refuses it as stale, while its writer was told it worked."""
    d = Daemon(str(tmp_path)).start()

    async def scenario() -> None:
        nonlocal d
        async with (
            RelayClient("thinker", d.socket, timeout=20) as w,
            RelayClient("talker", d.socket, timeout=20) as r,
        ):
            ask, asked, go = _held_call(monkeypatch, w._routes, "ask")
            put = asyncio.create_task(
                w.put({"x": torch.ones(MiB)}, to_stage="talker", request_id="r")
            )
            await asyncio.wait_for(asked.wait(), 30)
            d = await asyncio.to_thread(restarted, d, str(tmp_path))
            await w.status()  # re-attached to the new daemon, the put still planned
            await r.status()
            go.set()
            with pytest.raises(DaemonUnavailableError):
                ref = await asyncio.wait_for(put, 30)
                await r.get(ref)  # what the put's reader would have met
            monkeypatch.setattr(w._routes, "ask", ask)
            ref = await w.put({"y": torch.ones(4)}, to_stage="talker", request_id="s")
            assert ref.fields.origin.daemon_epoch == d.epoch
            assert torch.equal((await r.get(ref))["y"], torch.ones(4))
            await async_wait_until(
                lambda: d.pool().get("used_bytes", 0) == 0, 30, "the cancelled lease freed"
            )

    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        d.stop()


def test_a_gpu_pool_put_whose_lease_wait_spans_a_restart_fails(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool put's lease is the new daemon's, but the pools it mapped and its
    DataRef's epoch are the old one's: its copy would land where no reader
    looks, under a DataRef every reader refuses, while its writer was told it
    worked. The GPU side is taken as given (this path's CUDA calls come after
    the check); the lease, the restart and the re-attach are real."""
    d = Daemon(str(tmp_path)).start()

    async def scenario() -> None:
        nonlocal d
        async with RelayClient("thinker", d.socket, timeout=20) as w:
            paths, conn = w._gpu_paths, w._conn
            gpu = conn.gpu
            assert gpu is not None  # a GPU side exists on any host that maps the arena

            def old_pool(*args: Any) -> None:
                raise AssertionError("the put copied into the old daemon's pool")

            # A pool of the arena's name: the lease comes from a real grant.
            monkeypatch.setattr(gpu, "pools", {"": pb.CudaPool(name=SHM_POOL)})
            monkeypatch.setattr(gpu, "facts", lambda *a: object())
            monkeypatch.setattr(gpu, "route", lambda *a: Transport.CUDA_IPC_POOL)
            monkeypatch.setattr(gpu, "has_pool_for", lambda *a: True)
            monkeypatch.setattr(gpu, "pool_region", old_pool)
            monkeypatch.setattr(paths, "may_take", lambda plan: True)
            reserve, asked, go = _held_call(monkeypatch, conn.grants, "reserve")
            put = asyncio.create_task(
                w.put({"x": torch.ones(MiB)}, to_stage="talker", request_id="r")
            )
            await asyncio.wait_for(asked.wait(), 30)
            d = await asyncio.to_thread(restarted, d, str(tmp_path))
            await w.status()  # re-attached to the new daemon, the put still waiting
            go.set()
            with pytest.raises(DaemonUnavailableError, match="restarted during the put"):
                await asyncio.wait_for(put, 30)
            monkeypatch.setattr(conn.grants, "reserve", reserve)
            monkeypatch.setattr(paths, "may_take", lambda plan: False)
            async with RelayClient("talker", d.socket, timeout=20) as r:
                ref = await w.put({"y": torch.ones(4)}, to_stage="talker", request_id="s")
                assert torch.equal((await r.get(ref))["y"], torch.ones(4))
            await async_wait_until(
                lambda: d.pool().get("used_bytes", 0) == 0, 30, "the cancelled lease freed"
            )

    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        d.stop()


def test_close_during_a_reattach_fails_the_waiting_call_as_closed(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    import relayd_client._connection

    # Attempts far apart: the call below waits in the backoff when close() comes.
    monkeypatch.setattr(relayd_client._connection, "RECONNECT_CALLER_DELAY", 60.0)
    d = Daemon(str(tmp_path)).start()

    async def scenario() -> None:
        c = RelayClient("thinker", d.socket, timeout=30)
        await c.open()
        kill9(d.proc)  # type: ignore[arg-type]
        await async_wait_until(lambda: c._conn.lost, 30, "the client to see the daemon go")
        call = asyncio.create_task(c.status())
        await async_wait_until(lambda: c._conn._reattach_waiters, 30, "the call to wait")
        await c.close()
        with pytest.raises(SessionClosedError):
            await asyncio.wait_for(call, 30)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        if d.running():
            d.stop()


def _relayd_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum("/dev/shm/relayd." in line for line in f)


def _descriptors(*clients: SyncRelayClient) -> int:
    """This process's descriptors, less the one each client's session opens at its
    first frame sent from a caller's thread (a dup of the session socket, kept while
    the session lives): whether a restart's put went out that way or through the
    loop is timing, and the descriptor is the session's, not a restart's leftover."""
    return len(os.listdir("/proc/self/fd")) - sum(
        c._client._conn.session._raw is not None for c in clients
    )


def test_restarts_in_a_row_leave_no_mappings_descriptors_or_threads_behind(
    tmp_path: object,
) -> None:
    d = Daemon(str(tmp_path)).start()
    try:
        with (
            SyncRelayClient("thinker", d.socket, timeout=20) as w,
            SyncRelayClient("talker", d.socket, timeout=20) as r,
        ):
            # One restart first: what the client starts once (an executor's
            # worker per loop) is there before counting.
            for i in range(5):
                if i == 1:
                    # A put or get that finds the session still re-attaching runs on
                    # the client's loop, which hands a large copy to its default
                    # executor, whose worker lives as long as the loop. Whether the
                    # first restart's calls went that way is timing: start it here.
                    for client in (w, r):
                        assert client._loop is not None
                        client._loop.run(asyncio.to_thread(lambda: None), 5.0)
                    fds = _descriptors(w, r)
                    maps = _relayd_mappings()
                    threads = set(threading.enumerate())
                d = restarted(d, str(tmp_path))
                ref = w.put({"x": torch.full((MiB,), i)}, to_stage="talker", request_id=f"a{i}")
                got = r.get(ref)
                assert torch.equal(got["x"], torch.full((MiB,), i))
                del got
                assert w.daemon_epoch == r.daemon_epoch == d.epoch

            def left_behind() -> tuple[int, int, list[str]]:
                """New mappings, new descriptors, and the names of new threads."""
                return (
                    _relayd_mappings() - maps,
                    _descriptors(w, r) - fds,
                    sorted(t.name for t in set(threading.enumerate()) - threads),
                )

            def nothing_left() -> bool:
                mappings, descriptors, new_threads = left_behind()
                return mappings <= 0 and descriptors <= 0 and not new_threads

            # A restart's old loop thread and its executor workers end just after
            # the call that noticed the restart returns, so wait (with a deadline)
            # for them to go; a leak never does. What was there before and ends
            # meanwhile (another test's thread) is no leak.
            wait_until(
                nothing_left,
                timeout=20,
                what="the restarts to leave no mapping, descriptor or thread behind",
                state=left_behind,
            )
    finally:
        d.stop()


_WRITER = """
import sys, torch
from relayd_client import SyncRelayClient
with SyncRelayClient("thinker", sys.argv[1], timeout=20) as w:
    print(w.put({"x": torch.ones(1 << 20)}, to_stage="talker", request_id="r").to_bytes().hex())
"""


def _put_elsewhere(socket: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", _WRITER, socket], capture_output=True, timeout=60, check=True
    )
    return out.stdout.decode().strip()


def test_a_blocking_get_whose_copy_spans_a_restart_frees_nothing_of_the_new_daemon(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The get's lease died with the old daemon: its release must not reach the
    new one, where the same lease id may name another writer's fresh put."""
    d = Daemon(str(tmp_path)).start()
    try:
        # Written by another process: in this one, the put would be a local object.
        ref = DataRef.from_bytes(bytes.fromhex(_put_elsewhere(d.socket)))
        with (
            SyncRelayClient("talker", d.socket, timeout=20) as r,
            concurrent.futures.ThreadPoolExecutor(1) as pool,
        ):
            held = _HeldCopy(monkeypatch, "unpack_from")  # the blocking get copies here
            get = pool.submit(r.get, ref)
            assert held.entered.wait(30)
            d = restarted(d, str(tmp_path))
            r.status()  # re-attached to the new daemon
            fresh = DataRef.from_bytes(bytes.fromhex(_put_elsewhere(d.socket)))
            held.go.set()
            with contextlib.suppress(DaemonUnavailableError):
                get.result(30)
            got = r.get(fresh)
            assert torch.equal(got["x"], torch.ones(MiB))
    finally:
        d.stop()
