"""relayd on the embedded default in a container's default 64 MB /dev/shm.

The default arena's 64 MiB floor plus preflight's margin did not fit there, so a
plain `docker run` could not start. Reproduced without a container engine: a
private mount namespace with a 64 MiB tmpfs on /dev/shm.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests._daemon import wait_until

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs on /dev/shm needs root"),
]

READY_TIMEOUT = 30


def _serving(socket: str) -> bool:
    cp = subprocess.run(
        [sys.executable, "-m", "relayd", "health", "--socket", socket],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return cp.returncode == 0


def test_default_arena_starts_in_a_64mb_dev_shm_and_says_so(tmp_path: Path) -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare (util-linux) is not installed")
    socket = str(tmp_path / "relayd.sock")
    log_path = tmp_path / "daemon.log"
    script = 'mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm && exec "$0" "$@"'
    serve = [sys.executable, "-m", "relayd", "serve", "--socket", socket, "--node-id", "x"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [unshare, "--mount", "--propagation", "private", "sh", "-c", script, *serve],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(
            lambda: proc.poll() is not None or (os.path.exists(socket) and _serving(socket)),
            READY_TIMEOUT,
            "relayd to serve or exit",
        )
        text = log_path.read_text()
        assert proc.poll() is None, text
        assert "/dev/shm has only 64.0 MiB free (a container's default is 64 MB)" in text, text
        assert "so the SHM arena is 32.0 MiB" in text, text
        assert "--ipc=host" in text and "--shm-size" in text
    finally:
        if proc.poll() is None:
            proc.terminate()
        assert proc.wait(timeout=30) == 0
