"""A client reaches the daemon through the path it was given, not the daemon's own.

A daemon in a container puts its sockets in its ``/run/relayd``; the host (or
another container) mounts that directory somewhere else. The client must
derive the session socket from its own socket path (``<socket>.session``), not
use the path the daemon reports at attach, which may not exist on its side.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests._daemon import lines as _lines
from tests._daemon import running_daemon, wait_until

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
WORKER_TIMEOUT = 60


def _worker(
    prefix: list[str], args: list[str], stdin: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    cp = subprocess.run(
        [*prefix, sys.executable, "-m", "tests._workers", *args],
        input=stdin,
        capture_output=True,
        timeout=WORKER_TIMEOUT,
        cwd=REPO,
        check=False,
    )
    assert cp.returncode == 0, cp.stderr.decode()[-4000:]
    return cp


def _round_trip(prefix: list[str], socket: str) -> None:
    """An shm put and its get, writer and reader each in its own process."""
    w = _worker(prefix, ["write", "--socket", socket, "--sizes", str(MiB)])
    (line,) = _lines(w)
    ref_hex, digest, transport = line.split()
    assert transport == "shm"
    r = _worker(prefix, ["read", "--socket", socket], stdin=f"{ref_hex}\n\n".encode())
    assert _lines(r) == ["READY", digest]


def _drained(socket: str) -> bool:
    from relayd.status_view import fetch_status

    pool = fetch_status(socket).pools[0]
    return pool.used_bytes == 0 and pool.granted_bytes == 0


def test_socket_directory_through_another_symlink(tmp_path: Path) -> None:
    """The daemon's path to the directory is gone; the client's path is another link."""
    real = tmp_path / "real"
    real.mkdir()
    daemon_view, client_view = tmp_path / "daemon-view", tmp_path / "client-view"
    daemon_view.symlink_to(real)
    with running_daemon(str(daemon_view)) as d:
        daemon_view.unlink()
        client_view.symlink_to(real)
        socket = str(client_view / "relayd.sock")
        try:
            _round_trip([], socket)
            wait_until(lambda: _drained(socket), 10, "the arena to drain")
        finally:
            daemon_view.symlink_to(real)  # the daemon removes its sockets on stop
        assert d.stop() == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts in a private namespace need root")
def test_socket_directory_bind_mounted_elsewhere(tmp_path: Path) -> None:
    """As a container's host sees it: the directory bind-mounted, the daemon's path hidden."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare (util-linux) is not installed")
    real, view = tmp_path / "run-relayd", tmp_path / "host-view"
    real.mkdir()
    view.mkdir()
    with running_daemon(str(real)) as d:
        # Each worker runs in its own mount namespace where the daemon's
        # directory is an empty tmpfs and its contents appear only at `view`.
        prefix = [
            unshare,
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f'mount --bind "{real}" "{view}" && mount -t tmpfs tmpfs "{real}" && exec "$0" "$@"',
        ]
        _round_trip(prefix, str(view / "relayd.sock"))
        wait_until(lambda: _drained(d.socket), 10, "the arena to drain")
        assert d.stop() == 0
