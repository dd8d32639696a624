"""The CLI as an operator meets it: a daemon that is down, pipes, JSON, drain, --help."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from relayd import config
from tests._daemon import Daemon, run_worker, running_daemon

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
CLI_TIMEOUT = 60


def _cli(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relayd", *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
        check=False,
        **kw,  # type: ignore[arg-type]
    )


def _dead_socket(tmp_path: Path) -> str:
    """A socket file nobody listens on: what a daemon killed with SIGKILL leaves."""
    path = str(tmp_path / "relayd.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(path)
    return path


@pytest.mark.parametrize("command", ["status", "leases", "drain", "health"])
def test_daemon_down_reads_as_the_client_says_it(tmp_path: Path, command: str) -> None:
    path = _dead_socket(tmp_path)
    cp = _cli(command, "--socket", path)
    assert cp.returncode == 1
    assert cp.stderr.startswith(f"relayd: no relayd answers on {path} ("), cp.stderr
    assert "start it with `relayd serve`" in cp.stderr
    for raw in ("_InactiveRpcError", "debug_error_string", "StatusCode."):
        assert raw not in cp.stderr, cp.stderr


def test_missing_socket_names_the_path_and_the_fix(tmp_path: Path) -> None:
    path = str(tmp_path / "none.sock")
    cp = _cli("status", "--socket", path)
    assert cp.returncode == 1
    assert cp.stderr == (
        f"relayd: no relayd socket at {path}; start the daemon with `relayd serve` "
        "or name its socket with --socket (or RELAYD_SOCKET)\n"
    )


def test_json_numbers_are_numbers_and_states_have_one_spelling(tmp_path: Path) -> None:
    with running_daemon(str(tmp_path)) as d:
        run_worker(["write", "--socket", d.socket, "--request", "req-7", "--sizes", f"{MiB}"])
        st = json.loads(_cli("status", "--socket", d.socket, "--json").stdout)
        pool = st["pools"][0]
        for key in ("capacity_bytes", "used_bytes", "slots", "slot_size"):
            assert type(pool[key]) is int, (key, pool[key])
        assert st["leases_by_state"] == {"claimed": 0, "published": 1, "reserved": 0}
        assert st["state"] == "serving"
        (lease,) = st["leases"]
        assert lease["state"] == "published" and type(lease["bytes"]) is int
        assert type(lease["lease_id"]) is int
        leases = json.loads(_cli("leases", "--socket", d.socket, "--json").stdout)
        assert leases == [lease] or (
            [dict(x, age_seconds=0) for x in leases] == [dict(lease, age_seconds=0)]
        )


def test_status_into_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    """`relayd status | head -0`: the reader is gone before anything is written."""
    with running_daemon(str(tmp_path)) as d:
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            cp = subprocess.run(
                [sys.executable, "-m", "relayd", "status", "--socket", d.socket],
                stdout=write_end,
                stderr=subprocess.PIPE,
                text=True,
                timeout=CLI_TIMEOUT,
                check=False,
            )
        finally:
            os.close(write_end)
        assert cp.stderr == ""
        assert cp.returncode == 128 + signal.SIGPIPE


def test_drain_wait_returns_after_the_daemon_stopped(tmp_path: Path) -> None:
    d = Daemon(str(tmp_path)).start()
    cp = _cli("drain", "--wait", "--grace", "2", "--socket", d.socket)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.splitlines() == [
        f"relayd on {d.socket}: draining; leases in flight get up to 2s to be read",
        f"relayd on {d.socket}: stopped",
    ]
    # The lock is the daemon's last hold; the process itself exits right after.
    assert d.proc is not None and d.proc.wait(timeout=10) == 0


def test_drain_reports_the_daemons_own_grace(tmp_path: Path) -> None:
    d = Daemon(str(tmp_path), "--drain-grace", "7").start()
    cp = _cli("drain", "--socket", d.socket)
    assert cp.returncode == 0, cp.stderr
    assert (
        cp.stdout == f"relayd on {d.socket}: draining; leases in flight get up to 7s to be read\n"
    )
    assert d.stop() == 0


def test_serve_help_shows_every_default_and_env_name() -> None:
    cp = _cli("serve", "--help")
    assert cp.returncode == 0
    options = cp.stdout.split("options:", 1)[1].split("\n  -")
    lines = {"-" + " ".join(o.split()).split()[0]: " ".join(o.split()) for o in options[1:]}
    for f in dataclasses.fields(config.Settings):
        line = lines["--" + f.name.replace("_", "-")]
        assert f"[default: {config.default_text(f)}; env RELAYD_{f.name.upper()}]" in line, line
    assert "[default: 60; env RELAYD_LEASE_TTL]" in lines["--lease-ttl"]
    assert "[default: 1GiB; env RELAYD_SHM_SEGMENT_SIZE]" in lines["--shm-segment-size"]


def test_second_serve_on_a_busy_socket_says_only_why(tmp_path: Path) -> None:
    with running_daemon(str(tmp_path)) as d:
        cp = _cli("serve", "--socket", d.socket, "--shm-pool-size", "64MiB")
        assert cp.returncode == 2
        assert f"another relayd (pid {d.pid}) is serving on {d.socket}" in cp.stderr
        assert "relayd stopped" not in cp.stderr + cp.stdout
