"""``relayd drain`` run again on a daemon already draining."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests._daemon import Daemon, run_worker, wait_until

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def _drain(socket: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relayd", "drain", "--socket", socket, *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_a_second_drain_keeps_the_grace_it_reports(tmp_path: object) -> None:
    """The operator drains, then runs the drain again (to wait for it, or because the
    first seemed to hang): the leases in flight keep their grace, and the reply says
    the grace the daemon really gives."""
    d = Daemon(str(tmp_path), "--drain-grace", "60").start()
    refs = run_worker(["write", "--socket", d.socket, "--sizes", str(MiB)]).stdout.decode()
    first = _drain(d.socket)
    assert first.returncode == 0, first.stderr
    assert "up to 60s" in first.stdout
    wait_until(lambda: d.status()["state"] == "DAEMON_STATE_DRAINING", 10, "draining state")
    again = _drain(d.socket, "--grace", "30")
    assert again.returncode == 0, again.stderr
    assert "up to 60s" in again.stdout, again.stdout
    # The lease in flight is still readable, byte for byte.
    r = run_worker(["read", "--socket", d.socket], input=refs.encode() + b"\n")
    assert r.stdout.decode().split()[1] == refs.split()[1], r.stdout
    assert d.proc is not None and d.proc.wait(timeout=30) == 0
    assert d.segments() == []
