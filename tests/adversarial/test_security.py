"""Socket and segment permissions, SO_PEERCRED admission, and the limits that bound one client."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Iterator

import grpc
import pytest
from relayd_client import RelayClient, ResourceExhaustedError
from relayd_client.wire.framing import encode_frame
from relayd_client.wire.proto import relay_pb2 as pb

from tests._daemon import metric as _metric
from tests._figures import count
from tests._workers import make_payload
from tests.adversarial._raw import RawSession, events
from tests.faults._support import node_segments, start_daemon, unique_node

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
NOBODY = 65534
# Runs as another uid with the system interpreter and the standard library only
# (the test's virtualenv may not be readable by that uid): connect, send one
# Bind frame, print everything the daemon answers until it closes.
PROBE = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
try:
    s.sendall(bytes.fromhex(sys.argv[2]))
except OSError:  # refused and closed before our Bind went out: read the answer anyway
    pass
s.settimeout(10)
data = b""
while True:
    try:
        chunk = s.recv(65536)
    except OSError:  # reset: closed with our Bind unread; what came before it was kept
        break
    if not chunk:
        break
    data += chunk
print(data.hex())
"""


@pytest.fixture
def open_dir() -> Iterator[str]:
    """A directory anyone may enter, so file permissions are not what refuses the probe."""
    path = tempfile.mkdtemp(prefix="relayd-sec-", dir="/tmp")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _probe_as_nobody(session_socket: str) -> list[pb.Event]:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a client as another uid")
    bind = encode_frame(
        pb.SessionFrame(bind=pb.Bind(session_id="s1-none", session_token=b"x" * 16))
    )
    cp = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
         "/usr/bin/python3", "-c", PROBE, session_socket, bind.hex()],
        capture_output=True, timeout=30, check=True,
    )  # fmt: skip
    data = bytes.fromhex(cp.stdout.decode().strip())
    frames = []
    while len(data) >= 4:
        n = int.from_bytes(data[:4], "little")
        frames.append(pb.SessionFrame.FromString(data[4 : 4 + n]))
        data = data[4 + n :]
    return events(frames)


def test_sockets_and_segments_are_owner_and_group_only(tmp_path: object) -> None:
    node = unique_node()
    d = start_daemon(str(tmp_path), node, pool="16MiB")
    try:
        for path in (d.socket, d.socket + ".session"):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o660, path
        segs = [n for n in node_segments(node) if not n.endswith(".lock")]
        assert segs
        for name in segs:
            st = os.stat(os.path.join("/dev/shm", name))
            assert stat.S_IMODE(st.st_mode) == 0o660, name
            assert st.st_uid == os.getuid()
    finally:
        d.stop()


def test_another_uid_is_refused_logged_and_counted(open_dir: str) -> None:
    d = start_daemon(open_dir, unique_node(), "--socket-mode", "0666", pool="16MiB", metrics=True)
    try:
        # The socket is world-writable here: only SO_PEERCRED stands in the way.
        assert stat.S_IMODE(os.stat(d.socket + ".session").st_mode) == 0o666
        evs = _probe_as_nobody(d.socket + ".session")
        assert evs and evs[0].code == pb.ERROR_CODE_PERMISSION_DENIED, evs
        assert f"uid {NOBODY}" in evs[0].message
        count("connections from a disallowed uid")
        assert _metric(d.scrape(), "relayd_connections_refused_total", reason="uid") == 1
        assert "not allowed" in d.log()
    finally:
        d.stop()


def test_allow_uid_admits_that_uid(open_dir: str) -> None:
    d = start_daemon(open_dir, unique_node(), "--socket-mode", "0666", "--allow-uid",
                     str(NOBODY), pool="16MiB", metrics=True)  # fmt: skip
    try:
        evs = _probe_as_nobody(d.socket + ".session")
        # Admitted: it gets as far as the (bogus) session token.
        assert evs and evs[0].code != pb.ERROR_CODE_PERMISSION_DENIED, evs
        assert _metric(d.scrape(), "relayd_connections_refused_total", reason="uid") == 0
    finally:
        d.stop()


def test_session_limit(tmp_path: object) -> None:
    # One uid holds every session here: its own share must not be what refuses.
    d = start_daemon(str(tmp_path), unique_node(), "--max-sessions", "2",
                     "--max-uid-sessions", "3", pool="16MiB")  # fmt: skip

    async def scenario() -> None:
        async with RelayClient("a", d.socket), RelayClient("b", d.socket):
            with pytest.raises(ResourceExhaustedError, match="session limit"):
                async with RelayClient("c", d.socket):
                    pass
        async with RelayClient("c", d.socket):  # freed when the others closed
            pass

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        d.stop()


def test_grants_per_session_limit(tmp_path: object) -> None:
    d = start_daemon(str(tmp_path), unique_node(), "--max-session-grants", "1",
                     "--grant-size", "1MiB", pool="32MiB")  # fmt: skip

    async def scenario() -> None:
        async with RelayClient("thinker", d.socket) as w:
            await w.put(make_payload(1, MiB // 2), to_stage="talker", request_id="a")
            # The one grant holds an unread lease; a put that needs a second grant is refused.
            with pytest.raises(ResourceExhaustedError, match="max-session-grants"):
                await w.put(make_payload(2, 2 * MiB), to_stage="talker", request_id="b", timeout=1)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        d.stop()


def test_grant_calls_waiting_per_session_limit(tmp_path: object) -> None:
    d = start_daemon(str(tmp_path), unique_node(), "--max-grant-waits", "1", pool="16MiB")
    try:
        sess = RawSession(d.socket, "hog")
        sess.grant(8 * MiB)  # the stage's whole quota: the next grant must wait

        details: list[str] = []

        def ask(timeout: float) -> None:
            try:
                sess.grant(MiB, timeout=timeout)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                details.append(err.details() or "")

        t = threading.Thread(target=ask, args=(3.0,))
        t.start()
        # Whichever call comes second while the other waits is refused at once
        # (polled: a short call that found nobody waiting just times out).
        for _ in range(100):
            ask(0.01)
            if any("max-grant-waits" in x for x in details):
                break
        assert any("max-grant-waits" in x for x in details), details
        t.join(10)
        sess.close()
    finally:
        d.stop()


def test_bytes_per_stage_limit_is_a_clear_error(tmp_path: object) -> None:
    d = start_daemon(str(tmp_path), unique_node(), "--max-stage-bytes", "4MiB", pool="32MiB")

    async def scenario() -> None:
        async with RelayClient("thinker", d.socket) as w:
            with pytest.raises(ResourceExhaustedError, match="quota"):
                await w.put(make_payload(1, 5 * MiB), to_stage="talker", request_id="a", timeout=1)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        d.stop()
