"""A blocking put or get whose caller's thread is between two hot-path steps
when the daemon goes away (and, maybe, comes back) fails with the client's
error for a call that spans a restart: never a bare IndexError, a false
CorruptRefError, or bytes of the new daemon's arena read or written.

Each test holds the call at one step until the loop thread has torn the old
session down (``down``) or re-attached to a new daemon (``restarted``).
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch
from relayd_client import DaemonUnavailableError, DataRef, SyncRelayClient

from tests._daemon import Daemon, kill9, wait_until

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20


class _Held:
    """Replaces ``obj.name`` (on the instance) so that its first call waits until
    the test lets it go."""

    def __init__(self, obj: object, name: str) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        real = getattr(obj, name)

        def held(*args: Any, **kw: Any) -> Any:
            if not self.entered.is_set():
                self.entered.set()
                assert self.go.wait(60), "the test never let the call go"
            return real(*args, **kw)

        setattr(obj, name, held)


_WRITER = """
import sys, torch
from relayd_client import SyncRelayClient
with SyncRelayClient("thinker", sys.argv[1], timeout=20) as w:
    ref = w.put({"x": torch.full((1 << 20,), float(sys.argv[2]))}, to_stage="talker", request_id="r")
    print(ref.to_bytes().hex())
"""


def _put_elsewhere(socket: str, value: float) -> DataRef:
    """A put by another process (in this one, it would be a local object)."""
    out = subprocess.run(
        [sys.executable, "-c", _WRITER, socket, str(value)],
        capture_output=True,
        timeout=60,
        check=True,
    )
    return DataRef.from_bytes(bytes.fromhex(out.stdout.decode().strip()))


def _go_down(d: Daemon, client: SyncRelayClient) -> None:
    """Kill the daemon; wait until ``client`` has unmapped its arena."""
    conn = client._client._conn
    kill9(d.proc)  # type: ignore[arg-type]
    wait_until(lambda: conn.lost and not conn.views, 30, "the client to unmap the old arena")


def _restart(d: Daemon, tmp_path: object, client: SyncRelayClient) -> Daemon:
    """A new daemon on the same socket, and ``client`` re-attached to it."""
    _go_down(d, client)
    d = Daemon(str(tmp_path)).start()
    client.status()  # re-attached: the new daemon's arena is mapped
    assert client._client._conn.views and not client._client._conn.lost
    return d


@pytest.mark.parametrize("how", ["down", "restarted"])
def test_a_blocking_put_between_its_lease_and_its_copy_fails_and_writes_no_new_arena(
    tmp_path: object, how: str
) -> None:
    d = Daemon(str(tmp_path)).start()
    try:
        with (
            SyncRelayClient("thinker", d.socket, timeout=20) as w,
            concurrent.futures.ThreadPoolExecutor(1) as pool,
        ):
            held = _Held(w._client._writer, "fill_and_seal")  # after the lease is cut
            put = pool.submit(
                w.put, {"x": torch.full((MiB,), 7.0)}, to_stage="talker", request_id="a"
            )
            assert held.entered.wait(30)
            if how == "down":
                # Torn down, nothing attached yet: the new daemon comes up
                # only once the put has failed.
                _go_down(d, w)
                held.go.set()
                with pytest.raises(DaemonUnavailableError):
                    put.result(30)
                d = Daemon(str(tmp_path)).start()
                return
            d = _restart(d, tmp_path, w)
            # Another writer's put on the new daemon, likely in the slots the
            # held put's old lease had.
            fresh = _put_elsewhere(d.socket, 1.0)
            held.go.set()
            with pytest.raises(DaemonUnavailableError):
                put.result(30)
        with SyncRelayClient("talker", d.socket, timeout=20) as r:
            got = r.get(fresh)
            assert torch.equal(got["x"], torch.ones(MiB)), "the new daemon's arena was written"
    finally:
        d.stop()


@pytest.mark.parametrize("how", ["down", "restarted"])
def test_a_blocking_get_checking_its_lease_across_a_restart_fails_and_reads_no_new_arena(
    tmp_path: object, how: str
) -> None:
    d = Daemon(str(tmp_path)).start()
    try:
        old = _put_elsewhere(d.socket, 1.0)
        with (
            SyncRelayClient("talker", d.socket, timeout=20) as r,
            concurrent.futures.ThreadPoolExecutor(1) as pool,
        ):
            # Called by lease_region after its gate, before it looks at the arena.
            held = _Held(r._client._reader.checks, "check_not_released")
            get = pool.submit(r.get, old)
            assert held.entered.wait(30)
            if how == "down":
                _go_down(d, r)
                held.go.set()
                with pytest.raises(DaemonUnavailableError):
                    get.result(30)
                d = Daemon(str(tmp_path)).start()
                fresh = _put_elsewhere(d.socket, 2.0)
            else:
                d = _restart(d, tmp_path, r)
                # The same lease id, slot and length in the new arena, other bytes.
                fresh = _put_elsewhere(d.socket, 2.0)
                held.go.set()
                with pytest.raises(DaemonUnavailableError):
                    get.result(30)
            got = r.get(fresh)  # still there: the held get released nothing of it
            assert torch.equal(got["x"], torch.full((MiB,), 2.0))
    finally:
        d.stop()
