"""Operations against the real daemon: readiness notification, drain CLI, health, inspection CLI."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests._daemon import Daemon, free_port, run_worker, running_daemon, wait_until

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def _cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relayd", *args], capture_output=True, text=True, timeout=timeout
    )


def test_ready_and_stopping_reach_the_notify_socket(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(30)
        d = Daemon(str(tmp_path), env={"NOTIFY_SOCKET": path}).start()
        messages = [sock.recv(4096).decode()]
        assert messages[0].startswith("READY=1"), messages
        assert d.stop() == 0
        while "STOPPING=1" not in messages[-1]:
            messages.append(sock.recv(4096).decode())
    assert any(m.startswith("STOPPING=1") for m in messages)


def test_relayd_drain_waits_for_inflight_then_exits_clean(tmp_path: object) -> None:
    d = Daemon(str(tmp_path)).start()
    refs = run_worker(["write", "--socket", d.socket, "--sizes", str(MiB)]).stdout.decode()
    cp = _cli("drain", "--socket", d.socket, "--grace", "30")
    assert cp.returncode == 0, cp.stderr
    wait_until(lambda: d.status()["state"] == "DAEMON_STATE_DRAINING", 10, "draining state")
    health = _cli("health", "--socket", d.socket)
    assert health.returncode == 1 and "NOT_SERVING" in health.stdout
    # In-flight data is still readable while draining, then the daemon exits 0.
    r = run_worker(["read", "--socket", d.socket], input=refs.encode() + b"\n")
    assert r.stdout.decode().split()[1] == refs.split()[1]
    assert d.proc is not None and d.proc.wait(timeout=30) == 0
    assert d.segments() == []


def test_health_on_tcp_port_and_socket(tmp_path: object) -> None:
    port = free_port()
    with running_daemon(str(tmp_path), "--health-address", f"127.0.0.1:{port}") as d:
        tcp = _cli("health", "--address", f"127.0.0.1:{port}")
        assert tcp.returncode == 0 and tcp.stdout.strip() == "SERVING", tcp.stderr
        uds = _cli("health", "--socket", d.socket)
        assert uds.returncode == 0 and uds.stdout.strip() == "SERVING"


def test_status_leases_top_json_and_text(tmp_path: object) -> None:
    with running_daemon(str(tmp_path)) as d:
        run_worker(["write", "--socket", d.socket, "--request", "req-7", "--sizes", f"{MiB}"])
        st = json.loads(_cli("status", "--socket", d.socket, "--json").stdout)
        assert {"node_id", "daemon_epoch", "state", "pools", "leases", "sessions"} <= st.keys()
        pool = st["pools"][0]
        assert {"name", "capacity_bytes", "used_bytes", "largest_free_run_bytes"} <= pool.keys()
        assert st["leases_by_state"]["published"] == 1
        leases = json.loads(
            _cli("leases", "--socket", d.socket, "--json", "--stage", "talker").stdout
        )
        assert [x["request_id"] for x in leases] == ["req-7"]
        assert leases[0]["state"] == "published"
        none = json.loads(_cli("leases", "--socket", d.socket, "--json", "--request", "x").stdout)
        assert none == []
        top = _cli("top", "--socket", d.socket, "--iterations", "2", "--interval", "0.1", "--json")
        assert [json.loads(line)["state"] for line in top.stdout.splitlines()] == ["serving"] * 2
        text = _cli("status", "--socket", d.socket).stdout
        assert "req-7" in text or "published" in text
        assert all(len(line) <= 80 for line in text.splitlines())


def test_unreachable_daemon_is_a_clear_error(tmp_path: object) -> None:
    cp = _cli("status", "--socket", os.path.join(str(tmp_path), "none.sock"))
    assert cp.returncode == 1 and "no relayd socket at" in cp.stderr
