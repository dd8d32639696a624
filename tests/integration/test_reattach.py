"""Every call right after a daemon restart waits for the re-attach, the same way.

A client learns that its daemon went away from the session socket's EOF and
re-attaches in the background; a call made meanwhile must wait for that
(up to its own deadline), never fail because it came first.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch
from relayd_client import RelayClient, SyncRelayClient

from tests._daemon import Daemon, kill9, restarted, wait_until
from tests._daemon import drained as _drained
from tests._workers import digest

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _no_background_reattach(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backoff far longer than any test: after its first failed attempt (the
    daemon is still down) the client re-attaches only when a call needs it."""
    import relayd_client._connection

    monkeypatch.setattr(relayd_client._connection, "RECONNECT_FIRST_DELAY", 60.0)
    monkeypatch.setattr(relayd_client._connection, "RECONNECT_MAX_DELAY", 60.0)


def _tensor(seed: int) -> torch.Tensor:
    return torch.arange(MiB // 4, dtype=torch.int32) + seed


async def _restart_async(d: Daemon, tmp_path: object) -> Daemon:
    """``restarted`` with the client's loop running, so it sees the daemon go."""
    kill9(d.proc)  # type: ignore[arg-type]
    return await asyncio.to_thread(Daemon(str(tmp_path)).start)


def test_ref_right_after_a_daemon_restart_waits_for_the_reattach(tmp_path: object) -> None:
    d = Daemon(str(tmp_path)).start()

    async def scenario() -> None:
        nonlocal d
        async with (
            RelayClient("thinker", d.socket, timeout=20) as w,
            RelayClient("talker", d.socket, timeout=20) as r,
        ):
            first = await w.ref(_tensor(1), consumer_stage="talker", request_id="before")
            assert digest(await r.get(first.data_ref())) == digest(_tensor(1))
            old_epoch = w.daemon_epoch
            d = await _restart_async(d, tmp_path)
            second = await w.ref(_tensor(2), consumer_stage="talker", request_id="after")
            assert w.daemon_epoch != old_epoch
            assert digest(await r.get(second.data_ref())) == digest(_tensor(2))

    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
        wait_until(lambda: _drained(d), 10, "arena back to zero")
    finally:
        d.stop()


def test_blocking_ref_right_after_a_daemon_restart_waits_for_the_reattach(
    tmp_path: object,
) -> None:
    d = Daemon(str(tmp_path)).start()
    try:
        with (
            SyncRelayClient("thinker", d.socket, timeout=20) as w,
            SyncRelayClient("talker", d.socket, timeout=20) as r,
        ):
            first = w.ref(_tensor(1), consumer_stage="talker", request_id="before")
            assert digest(r.get(first.data_ref())) == digest(_tensor(1))
            old_epoch = w.daemon_epoch
            d = restarted(d, str(tmp_path))
            second = w.ref(_tensor(2), consumer_stage="talker", request_id="after")
            assert w.daemon_epoch != old_epoch
            assert digest(r.get(second.data_ref())) == digest(_tensor(2))
        wait_until(lambda: _drained(d), 10, "arena back to zero")
    finally:
        d.stop()


async def _buffer(c: RelayClient) -> Any:
    async with c.buffer(to_stage="talker", request_id="b", like={"x": _tensor(0)}) as out:
        out.payload["x"].copy_(_tensor(3))
    return out.ref


# Each public call that needs the daemon, made first thing after a restart.
CALLS: dict[str, Callable[[RelayClient], Awaitable[Any]]] = {
    "put": lambda c: c.put({"x": _tensor(4)}, to_stage="talker", request_id="p"),
    "buffer": _buffer,
    "status": lambda c: c.status(),
    "abort": lambda c: c.abort("p"),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_each_call_right_after_a_daemon_restart_waits_for_the_reattach(
    tmp_path: object, name: str
) -> None:
    d = Daemon(str(tmp_path)).start()

    async def scenario() -> None:
        nonlocal d
        async with RelayClient("thinker", d.socket, timeout=20) as c:
            old_epoch = c.daemon_epoch
            d = await _restart_async(d, tmp_path)
            await CALLS[name](c)
            assert c.daemon_epoch != old_epoch

    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        d.stop()


# A reader in its own process: it keeps a zero-copy view of one put, waits for
# the parent to restart the daemon, re-attaches (mapping the new arena), then
# reads the view again. Run apart from pytest: a dangling view is a SIGSEGV.
_VIEW_HOLDER = """
import sys
from relayd_client import DataRef, SyncRelayClient
from tests._workers import digest

with SyncRelayClient("talker", sys.argv[1], timeout=20) as r:
    view = r.get(DataRef.from_bytes(bytes.fromhex(sys.stdin.readline())), copy=False)
    epoch = r.daemon_epoch
    print(digest(view), flush=True)
    sys.stdin.readline()  # the daemon was restarted
    r.status()  # waits for the re-attach, which unmaps the old arena
    assert r.daemon_epoch != epoch
    print(digest(view), flush=True)
"""


def test_a_zero_copy_view_stays_readable_after_the_daemon_restarts(tmp_path: object) -> None:
    """Re-attaching maps the new daemon's arena and lets go of the old one; a
    view the application still holds into the old one keeps its mapping (and
    its bytes) until the view is dropped, instead of pointing at unmapped memory."""
    d = Daemon(str(tmp_path)).start()
    reader = subprocess.Popen(
        [sys.executable, "-c", _VIEW_HOLDER, d.socket],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdin is not None and reader.stdout is not None
        with SyncRelayClient("thinker", d.socket, timeout=20) as w:
            ref = w.put({"t": _tensor(7)}, to_stage="talker", request_id="viewed")
            reader.stdin.write(ref.to_bytes().hex() + "\n")
            reader.stdin.flush()
            before = reader.stdout.readline().strip()
            assert before == digest({"t": _tensor(7)})
            d = restarted(d, str(tmp_path))
            out, _ = reader.communicate("restarted\n", timeout=60)
        # -11 (SIGSEGV): the view pointed into an arena the client had unmapped.
        assert reader.returncode == 0, reader.returncode
        assert out.split() == [before]
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait(timeout=10)
        d.stop()
