"""``relayd serve`` refuses to start on a node that cannot run it, and says why.

Each test runs the real CLI in a subprocess under one broken condition and
expects exit status 2 with that check's message on stderr.
"""

from __future__ import annotations

import os
import pathlib
import resource
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT = 30.0
EXIT_PREFLIGHT = 2


def child_env() -> dict[str, str]:
    """This environment minus anything that would configure the daemon or systemd."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("RELAYD_") and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def serve_command(sock: pathlib.Path, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "relayd",
        "serve",
        "--socket",
        str(sock),
        "--shm-pool-size",
        "64MiB",
        *flags,
    ]


def run(
    argv: Sequence[str], preexec_fn: Callable[[], None] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        cwd=REPO,
        env=child_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        preexec_fn=preexec_fn,
    )


def assert_refused(result: subprocess.CompletedProcess[str], failure: str) -> None:
    assert result.returncode == EXIT_PREFLIGHT, result.stderr
    assert f"  - {failure}\n" in result.stderr, result.stderr


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_small_dev_shm(tmp_path: pathlib.Path) -> None:
    # A private mount namespace with a 16 MiB tmpfs on /dev/shm, like a container's default.
    inner = shlex.join(serve_command(tmp_path / "s.sock"))
    user = [] if os.geteuid() == 0 else ["--map-root-user"]
    result = run(
        [
            "unshare",
            *user,
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f"mount -t tmpfs -o size=16m tmpfs /dev/shm && exec {inner}",
        ]
    )
    assert_refused(
        result,
        "/dev/shm has 16.0 MiB free but the SHM arena needs 80.0 MiB (shm_pool_size 64.0 MiB "
        "+ 16.0 MiB margin). Containers get a 64 MB /dev/shm by default: run with docker "
        "--shm-size (e.g. --shm-size=2g), use hostIPC: true on Kubernetes, or lower "
        "--shm-pool-size",
    )


def test_memlock_too_low_for_pinning(tmp_path: pathlib.Path) -> None:
    def limit_memlock() -> None:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, 64 << 10))

    result = run(serve_command(tmp_path / "s.sock", "--pin-host-memory", "on"), limit_memlock)
    assert_refused(
        result,
        "RLIMIT_MEMLOCK is 64.0 KiB but pin_host_memory is on, which page-locks the 64.0 MiB "
        "SHM arena: set LimitMEMLOCK=infinity in the systemd unit, run `ulimit -l unlimited` "
        "(docker: --ulimit memlock=-1), or use --pin-host-memory off",
    )


def test_metrics_port_taken(tmp_path: pathlib.Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        result = run(serve_command(tmp_path / "s.sock", "--metrics-address", address))
    assert_refused(
        result,
        f"metrics_address {address}: the port is taken (address already in use); stop what "
        "listens there or choose another port with --metrics-address",
    )


def test_socket_directory_cannot_be_created(tmp_path: pathlib.Path) -> None:
    # Root may write anywhere, so make the directory impossible instead: its parent is a file.
    afile = tmp_path / "afile"
    afile.write_text("")
    result = run(serve_command(afile / "s.sock"))
    assert_refused(
        result,
        f"socket directory {afile} cannot be created: {afile} is not a directory; "
        "choose another --socket",
    )
