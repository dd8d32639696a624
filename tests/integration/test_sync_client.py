"""SyncRelayClient against a real daemon: threads, errors, re-attach, close, no caller loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from relayd_client import (
    AbortedError,
    DataRef,
    RelayClient,
    RelayError,
    SessionClosedError,
    StaleEpochError,
    SyncRelayClient,
    Transport,
)

from tests._daemon import Daemon, kill9, reap, running_daemon, wait_until
from tests._daemon import drained as _drained
from tests._fixtures import separate_processes
from tests._workers import digest, make_payload

__all__ = ["separate_processes"]  # the autouse fixture: clients here use the arena

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20


def test_threads_put_and_get_at_once_bytes_intact_arena_back_to_zero(tmp_path: object) -> None:
    sizes = [100, 20_000, 256 * 1024, MiB, 3 * MiB + 7]
    writers, per_writer = 4, 12
    with running_daemon(str(tmp_path), "--grant-size", "4MiB", pool="96MiB") as d:
        with (
            SyncRelayClient("thinker", d.socket) as w,
            SyncRelayClient("talker", d.socket) as r,
        ):
            refs: queue.Queue[tuple[bytes, str] | None] = queue.Queue()

            def write(k: int) -> None:
                for i in range(per_writer):
                    payload = make_payload(k * 100 + i, sizes[(k + i) % len(sizes)])
                    ref = w.put(payload, to_stage="talker", request_id=f"w{k}-{i}", timeout=30)
                    refs.put((ref.to_bytes(), digest(payload)))

            def read() -> list[bool]:
                seen = []
                while (item := refs.get(timeout=60)) is not None:
                    wire, want = item
                    seen.append(digest(r.get(DataRef.from_bytes(wire))) == want)
                return seen

            with concurrent.futures.ThreadPoolExecutor(writers + 3) as pool:
                readers = [pool.submit(read) for _ in range(3)]
                for f in [pool.submit(write, k) for k in range(writers)]:
                    f.result(timeout=120)
                for _ in readers:
                    refs.put(None)
                results = [ok for f in readers for ok in f.result(timeout=120)]
            assert len(results) == writers * per_writer and all(results)
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def test_view_release_ref_and_streams(tmp_path: object) -> None:
    with running_daemon(str(tmp_path), pool="32MiB") as d:
        with (
            SyncRelayClient("thinker", d.socket) as w,
            SyncRelayClient("talker", d.socket) as r,
        ):
            x = torch.arange(200_000, dtype=torch.float32)
            ref = w.put({"x": x}, to_stage="talker", request_id="v")
            assert ref.transport is Transport.SHM
            with r.view(ref) as obj:
                assert torch.equal(obj["x"], x)
            tref = w.ref(x * 2, consumer_stage="talker", request_id="t")
            outer = w.put({"t": tref, "n": 3}, to_stage="talker", request_id="t")
            got = r.get(outer)
            assert got["n"] == 3 and torch.equal(got["t"], x * 2)
            for i in range(3):
                r.feed(
                    w.put(torch.full((50_000,), i), to_stage="talker", request_id="s", chunk_id=i)
                )
            r.feed(w.put_done("talker", "s"))
            chunks = list(r.stream("s", from_stage="thinker", timeout=10))
            assert [int(c[0]) for c in chunks] == [0, 1, 2]
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def _outcome(call: Callable[[], Any]) -> type[BaseException] | None:
    try:
        call()
    except RelayError as exc:
        return type(exc)
    return None


def test_errors_are_the_async_clients_exact_types(tmp_path: object) -> None:
    big = torch.zeros(40 * MiB // 4)
    x = torch.arange(100_000)

    def cases(
        put: Callable[..., DataRef], get: Callable[..., Any], abort: Callable[[str], int]
    ) -> list[Callable[[], Any]]:
        ref = put({"x": x}, to_stage="talker", request_id="e1")
        get(ref)
        aborted = put({"x": x}, to_stage="talker", request_id="e2")
        abort("e2")
        other = put({"x": x}, to_stage="critic", request_id="e3")
        return [
            lambda: get(ref),  # read twice
            lambda: get(aborted),
            lambda: get(other),  # addressed to another stage
            lambda: put(x, to_stage="", request_id="e4"),
            lambda: put(x, to_stage="talker", request_id="e4", chunk_id=-1),
            lambda: put(big, to_stage="talker", request_id="e5", timeout=0.5),
            lambda: put(x, to_stage="talker", request_id="e2"),  # aborted request
        ]

    with running_daemon(str(tmp_path), "--grant-size", "1MiB", pool="16MiB") as d:
        with (
            SyncRelayClient("thinker", d.socket) as w,
            SyncRelayClient("talker", d.socket) as r,
        ):
            sync_errors = [_outcome(c) for c in cases(w.put, r.get, w.abort)]
            sync_errors.append(_outcome(lambda: r.get(w.put_done("talker", "e6"))))
        sync_errors.append(_outcome(lambda: w.put(x, to_stage="talker", request_id="e7")))

        async def async_side() -> list[type[BaseException] | None]:
            aw = RelayClient("thinker", d.socket)
            ar = RelayClient("talker", d.socket)
            await aw.open()
            await ar.open()
            loop = asyncio.get_running_loop()

            def blocking(fn: Callable[..., Any]) -> Callable[..., Any]:
                # The cases are written blocking; run each coroutine to its end
                # on this loop from a worker thread.
                def call(*a: Any, **kw: Any) -> Any:
                    return asyncio.run_coroutine_threadsafe(fn(*a, **kw), loop).result(30)

                return call

            def run_all() -> list[type[BaseException] | None]:
                out = [
                    _outcome(c)
                    for c in cases(blocking(aw.put), blocking(ar.get), blocking(aw.abort))
                ]
                done = aw.put_done("talker", "e6")
                out.append(_outcome(lambda: blocking(ar.get)(done)))
                return out

            errors = await asyncio.to_thread(run_all)
            await aw.close()
            await ar.close()
            errors.append(await _async_outcome(aw.put(x, to_stage="talker", request_id="e7")))
            return errors

        async_errors = asyncio.run(asyncio.wait_for(async_side(), 120))
        assert sync_errors == async_errors
        assert None not in sync_errors
        assert AbortedError in sync_errors and SessionClosedError in sync_errors


async def _async_outcome(coro: Any) -> type[BaseException] | None:
    try:
        await coro
    except RelayError as exc:
        return type(exc)
    return None


def test_reattach_after_daemon_restart(tmp_path: object) -> None:
    d = Daemon(str(tmp_path)).start()
    try:
        with (
            SyncRelayClient("thinker", d.socket, timeout=5) as w,
            SyncRelayClient("talker", d.socket, timeout=5) as r,
        ):
            old_epoch = w.daemon_epoch
            unread = w.put(make_payload(1, MiB), to_stage="talker", request_id="old")
            kill9(d.proc)  # type: ignore[arg-type]
            d = Daemon(str(tmp_path)).start()  # same socket
            payload = make_payload(2, MiB)
            ref = w.put(payload, to_stage="talker", request_id="new", timeout=20)
            assert w.daemon_epoch != old_epoch
            assert digest(r.get(ref)) == digest(payload)
            with pytest.raises(StaleEpochError):
                r.get(unread)
        wait_until(lambda: _drained(d), 10, "arena back to zero")
    finally:
        d.stop()


def test_close_from_another_thread_ends_blocked_and_later_calls(tmp_path: object) -> None:
    with running_daemon(str(tmp_path), pool="32MiB") as d:
        c = SyncRelayClient("talker", d.socket)
        c.open()
        started = threading.Event()
        outcome: list[type[BaseException] | None] = []

        def wait_for_stream() -> None:
            started.set()
            try:
                list(c.stream("never", from_stage="thinker", timeout=60))
            except RelayError as exc:
                outcome.append(type(exc))
            else:
                outcome.append(None)

        t = threading.Thread(target=wait_for_stream)
        t.start()
        assert started.wait(10)
        wait_until(lambda: c._client._streams.has("never"), 10, "the stream to be waiting")
        closer = threading.Thread(target=c.close)
        closer.start()
        closer.join(30)
        t.join(30)
        assert not t.is_alive() and not closer.is_alive()
        assert outcome == [SessionClosedError]
        with pytest.raises(SessionClosedError):
            c.put(torch.ones(10), to_stage="thinker", request_id="x")
        with pytest.raises(SessionClosedError):
            c.open()
        c.close()  # twice is fine
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def test_hot_path_never_hops_to_the_loop(tmp_path: object) -> None:
    # One grant holds every put below (21 x 19 slots): whether a put finds room must
    # not depend on when the reader's frees come back (they linger), only the path.
    with (
        running_daemon(str(tmp_path), "--grant-size", "28MiB", pool="64MiB") as d,
        SyncRelayClient("thinker", d.socket) as w,
        SyncRelayClient("talker", d.socket) as r,
    ):
        x = torch.arange(300_000, dtype=torch.float32)
        # The route of each size class (inline or not) and a grant.
        r.get(w.put({"x": x}, to_stage="talker", request_id="warm"))
        r.get(w.put({"small": torch.ones(10)}, to_stage="talker", request_id="warm"))
        hops = 0
        for c in (w, r):
            lt = c._loop
            assert lt is not None
            real = lt.run

            def counted(coro: Any, wait: float | None, real: Any = real) -> Any:
                nonlocal hops
                hops += 1
                return real(coro, wait)

            lt.run = counted  # type: ignore[method-assign]
        for i in range(20):
            for payload in ({"x": x}, {"small": torch.ones(10)}):
                got = r.get(w.put(payload, to_stage="talker", request_id=f"h{i}"))
                assert digest(got) == digest(payload)
        assert hops == 0


SCRIPT = """
import sys, threading
import torch
import relayd_client._local
relayd_client._local.serves = lambda stage: False
from relayd_client import SyncRelayClient

def main():
    with SyncRelayClient("thinker", sys.argv[1]) as w, SyncRelayClient("talker", sys.argv[1]) as r:
        x = torch.arange(1 << 18, dtype=torch.float32)
        ref = w.put({"x": x}, to_stage="talker", request_id="r")
        assert torch.equal(r.get(ref)["x"], x)
        import asyncio
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            print("no loop in the caller", ref.transport.value)

t = threading.Thread(target=main)
t.start()
t.join(60)
"""


def test_put_get_from_a_plain_thread_in_a_fresh_process(tmp_path: object) -> None:
    with running_daemon(str(tmp_path), pool="32MiB") as d:
        cp = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(SCRIPT), d.socket],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert cp.returncode == 0, cp.stderr
        assert cp.stdout.strip() == "no loop in the caller shm"


def test_every_put_and_get_of_both_clients_ends_in_one_place(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    monkeypatch.setattr(
        RelayClient, "_put_finished", lambda self, ref, t0: seen.append("put") or ref
    )
    monkeypatch.setattr(
        RelayClient, "_get_finished", lambda self, ref, obj, t0: seen.append("get") or obj
    )
    x = torch.arange(100_000)
    with running_daemon(str(tmp_path), pool="32MiB") as d:
        with (
            SyncRelayClient("thinker", d.socket) as w,
            SyncRelayClient("talker", d.socket) as r,
        ):
            tref = w.ref(x, consumer_stage="talker", request_id="f")
            for payload in ({"x": x}, {"small": 1}, {"t": tref}):
                r.get(w.put(payload, to_stage="talker", request_id="f"))
        assert seen == ["put", "get"] * 3

        async def async_side() -> None:
            async with (
                RelayClient("thinker", d.socket) as aw,
                RelayClient("talker", d.socket) as ar,
            ):
                tref = await aw.ref(x, consumer_stage="talker", request_id="g")
                for payload in ({"x": x}, {"small": 1}, {"t": tref}):
                    await ar.get(await aw.put(payload, to_stage="talker", request_id="g"))

        seen.clear()
        asyncio.run(asyncio.wait_for(async_side(), 60))
        assert seen == ["put", "get"] * 3


def test_a_forked_child_cannot_use_its_parents_session_and_the_parent_is_unharmed(
    tmp_path: object,
) -> None:
    """The child inherits the parent's session socket, grants and arena mapping:
    a put there would cut a lease from slots the parent also hands out. The
    child gets SessionClosedError at the first call, closes without I/O on
    what it shares with the parent, and is told at once that it cannot open a
    client of its own; the parent goes on."""
    import os
    import time

    with running_daemon(str(tmp_path)) as d:
        with SyncRelayClient("thinker", d.socket) as w, SyncRelayClient("talker", d.socket) as r:
            payload = make_payload(1, MiB)  # made before the fork: torch's threads do not follow
            assert digest(r.get(w.put(payload, to_stage="talker", request_id="pre"))) == digest(
                payload
            )
            pid = os.fork()
            if pid == 0:  # the child: report by exit code, never return into pytest
                code = 1
                try:
                    try:
                        w.put(payload, to_stage="talker", request_id="child")
                    except SessionClosedError as exc:
                        code = 0 if "fork" in str(exc) else 2
                    started = time.monotonic()
                    w.close()
                    r.close()
                    if time.monotonic() - started > 1.0:
                        code = 3  # close waited on the parent's loop
                    # Nor can it open its own: gRPC does not survive the fork (an
                    # Attach there hung until its deadline). It is told at once.
                    started = time.monotonic()
                    try:
                        SyncRelayClient("vocoder", d.socket, timeout=5).open()
                        code = 4
                    except SessionClosedError as exc:
                        if "spawn" not in str(exc) or time.monotonic() - started > 1.0:
                            code = 5
                    except Exception:  # a timeout after the hang, say
                        code = 6
                finally:
                    os._exit(code)
            assert reap(pid, 30, "the forked child to finish") == 0
            for i in range(20):  # the parent's session and grant are intact
                more = make_payload(10 + i, MiB)
                ref = w.put(more, to_stage="talker", request_id=f"after-{i}")
                assert digest(r.get(ref)) == digest(more)
        wait_until(lambda: _drained(d), 10, "arena back to zero")
