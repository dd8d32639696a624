"""Every connection and session is bounded: idle floods, unbound frames, Attach floods,
huge messages (item 4 of the trust-boundary issue; figures go to the run's summary)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest
from relayd_client import RelayClient
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.proto import relay_pb2_grpc as pb_grpc

from tests._daemon import Daemon, wait_until
from tests._figures import record
from tests._workers import make_payload
from tests.adversarial._raw import events, read_frames, stub
from tests.adversarial._users import OTHER, ROOT, User, ensure_users, shared_dir
from tests.faults._support import fd_count, rss_bytes, unique_node

pytestmark = pytest.mark.timeout(240)

MiB = 1 << 20
FLOOD = 1100  # connections per socket, as in the report that found the defect
BIND_DEADLINE = 10.0  # relayd.pools.sessions.BIND_DEADLINE


@pytest.fixture
def home() -> Iterator[str]:
    path = shared_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


async def _round_trip(sock: str) -> None:
    async with RelayClient("thinker", sock, timeout=10) as w, RelayClient("talker", sock) as r:
        ref = await w.put(make_payload(7, MiB), to_stage="talker", request_id="legit")
        got = await r.get(ref)
        assert set(got) == set(make_payload(7, MiB))


def test_idle_connection_flood_is_bounded(home: str) -> None:
    users = ensure_users()
    flooder: User = users[OTHER]
    d = Daemon(home, "--socket-mode", "0666", "--allow-uid", str(flooder.uid),
               "--max-sessions", "256", node_id=unique_node()).start()  # fmt: skip
    try:
        asyncio.run(asyncio.wait_for(_round_trip(d.socket), 60))  # warm: first-use allocations
        fds0, rss0 = fd_count(d.pid), rss_bytes(d.pid)
        proc = subprocess.Popen(
            flooder.argv([sys.executable, "-m", "tests.adversarial._flood",
                          d.socket + ".session", d.socket, str(FLOOD)]),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, text=True,
        )  # fmt: skip
        try:
            assert proc.stdout is not None and proc.stdin is not None
            ready = proc.stdout.readline().split()
            assert ready and ready[0] == "ready", ready
            fds_flood, rss_flood = fd_count(d.pid), rss_bytes(d.pid)
            # The flood still holds every connection it got; the daemon lets go of
            # them by the bind deadline (plus the housekeeping tick).
            with contextlib.suppress(TimeoutError):
                wait_until(lambda: fd_count(d.pid) <= fds0 + 8, BIND_DEADLINE + 20, "", 0.5)
            fds1, rss1 = fd_count(d.pid), rss_bytes(d.pid)
            record(
                "idle-connection flood (1,100 session + 1,100 gRPC connections, one uid)",
                f"daemon fds {fds0} before, {fds_flood} under the flood, {fds1} after the bind "
                f"deadline; RSS {rss0 / MiB:.1f} MiB before, {rss_flood / MiB:.1f} MiB under, "
                f"{rss1 / MiB:.1f} MiB after (connects that succeeded: {ready[1:]})",
            )
            # The flood still holds every connection it got; the daemon let go of them.
            assert fds1 <= fds0 + 8, (fds0, fds_flood, fds1)
            assert rss1 - rss0 < 32 * MiB, (rss0, rss1)
            asyncio.run(asyncio.wait_for(_round_trip(d.socket), 60))
        finally:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=30)
            if proc.stdout is not None:
                proc.stdout.close()
    finally:
        d.stop()


def test_a_large_frame_before_bind_closes_the_connection(home: str) -> None:
    d = Daemon(home, node_id=unique_node()).start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(d.socket + ".session")
            s.sendall((64 << 10).to_bytes(4, "little") + b"\0" * 1024)
            frames, closed = read_frames(s, 10)
        evs = events(frames)
        assert closed and evs and "before a session is bound" in evs[0].message, evs
    finally:
        d.stop()


def test_a_connection_that_never_binds_is_closed_at_the_deadline(home: str) -> None:
    d = Daemon(home, node_id=unique_node()).start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(d.socket + ".session")
            frames, closed = read_frames(s, BIND_DEADLINE + 10)
        evs = events(frames)
        assert closed and evs and evs[0].code == pb.ERROR_CODE_TIMEOUT, evs
        assert "no session bound" in evs[0].message
    finally:
        d.stop()


def test_per_uid_cap_leaves_room_for_other_uids(home: str) -> None:
    users = ensure_users()
    flooder = users[OTHER]
    d = Daemon(home, "--socket-mode", "0666", "--allow-uid", str(flooder.uid),
               "--max-uid-sessions", "16", node_id=unique_node()).start()  # fmt: skip
    try:
        # 40 connections of one uid that send nothing: 16 are held, the rest refused.
        cp = subprocess.run(
            flooder.argv([sys.executable, "-c", _HOLD, d.socket + ".session", "40"]),
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        refused = cp.stdout.split()
        assert refused[:1] == ["refused"], (cp.stdout, cp.stderr)
        assert int(refused[1]) == 40 - 16, cp.stdout
        # Another uid (root here) is not affected by that uid's share.
        asyncio.run(asyncio.wait_for(_round_trip(d.socket), 60))
    finally:
        d.stop()


# Opens N session connections and holds them; counts those the daemon refuses with an
# error event at once. Standard library only (runs as another uid).
_HOLD = """
import select, socket, sys, time
held = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    held.append(s)
refused, deadline = set(), time.monotonic() + 3
while time.monotonic() < deadline:
    ready, _, _ = select.select([s for s in held if s not in refused], [], [], 0.2)
    refused.update(ready)
print("refused", len(refused))
"""


def test_attach_flood_does_not_fill_max_sessions(home: str) -> None:
    d = Daemon(home, "--max-sessions", "100", node_id=unique_node()).start()
    try:
        with stub(d.socket) as st:
            for i in range(300):  # attach, never bind
                st.Attach(
                    pb.AttachRequest(protocol_version=1, stages=[f"flood{i}"], pid=1), timeout=5
                )
        asyncio.run(asyncio.wait_for(_round_trip(d.socket), 60))
    finally:
        d.stop()


def test_huge_messages_are_refused_before_they_are_buffered(home: str) -> None:
    d = Daemon(home, node_id=unique_node()).start()  # a 64 MiB arena
    try:
        hwm0 = _hwm(d.pid)
        big = pb.AttachRequest(
            protocol_version=1, stages=["thinker"], namespaces={"x": "y" * (300 * MiB)}
        )
        opts = [("grpc.max_send_message_length", 1 << 30)]
        with grpc.insecure_channel(f"unix:{d.socket}", options=opts) as ch:
            st = pb_grpc.RelayStub(ch)
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                codes = list(
                    pool.map(lambda _: _code(lambda: st.Attach(big, timeout=60)), range(3))
                )
        hwm1 = _hwm(d.pid)
        record(
            "three concurrent 300 MiB Attach messages",
            f"daemon peak RSS {hwm0 / MiB:.0f} MiB before, {hwm1 / MiB:.0f} MiB after; {codes}",
        )
        assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3, codes
        assert hwm1 - hwm0 < 128 * MiB, (hwm0, hwm1)
    finally:
        d.stop()


def _code(call: object) -> grpc.StatusCode:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as err:
        return err.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK
