"""The relayd daemon the relayd methods talk to: started here, or an already running one.

Started: ``python -m relayd serve --socket <tmp>/relayd.sock --shm-pool-size 512MiB``
in its own session (a Ctrl-C at the terminal reaches the benchmark, which then
stops the daemon with SIGTERM so it drains and unlinks its segments). Ready means
the socket exists and the standard gRPC health service answers SERVING.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
STOP_TIMEOUT_S = 15.0


class DaemonError(RuntimeError):
    """The daemon could not be started or reached; the message says why."""


@dataclasses.dataclass
class Daemon:
    socket: str
    pid: int | None
    started: bool
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    exit_code: int | None = None
    leftover_segments: tuple[str, ...] = ()

    def log_tail(self, lines: int = 15) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        """SIGTERM (drain), then SIGKILL after a grace period; note segments it left behind."""
        if self.proc is None:
            return
        # Ours are the segments it has open: other daemons may share this host's /dev/shm.
        owned = shm_files_of(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.exit_code = self.proc.returncode
        self.leftover_segments = tuple(sorted(n for n in owned if os.path.exists(SHM_DIR / n)))

    def describe(self) -> dict[str, object]:
        return {
            "socket": self.socket,
            "pid": self.pid,
            "started_by_bench": self.started,
            "exit_code": self.exit_code,
            "leftover_segments": list(self.leftover_segments),
        }


def shm_files_of(pid: int) -> frozenset[str]:
    """Names of the /dev/shm files a process has mapped or open (and not yet unlinked)."""
    prefix = f"{SHM_DIR}/"
    paths: list[str] = []
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps", encoding="utf-8") as f:
        paths += [line.split(maxsplit=5)[-1].rstrip("\n") for line in f]
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                paths.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return frozenset(
        p[len(prefix) :] for p in paths if p.startswith(prefix) and not p.endswith(" (deleted)")
    )


def start(tmpdir: Path, pool_size: str, timeout_s: float) -> Daemon:
    sock = tmpdir / "relayd.sock"
    log = tmpdir / "relayd.log"
    cmd = [sys.executable, "-m", "relayd", "serve", "--socket", str(sock)]
    cmd += ["--shm-pool-size", pool_size]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    d = Daemon(str(sock), proc.pid, True, proc, log)
    try:
        wait_ready(str(sock), timeout_s, proc)
    except BaseException as exc:
        d.stop()
        said = " | ".join(line.strip() for line in d.log_tail(5).splitlines() if line.strip())
        raise DaemonError(f"{exc}: {said}" if said else str(exc)) from exc
    return d


def attach(sock: str, timeout_s: float) -> Daemon:
    """An already running daemon: check it answers, and find its pid for CPU accounting."""
    wait_ready(sock, timeout_s, None)
    return Daemon(sock, peer_pid(sock), False)


def peer_pid(path: str) -> int | None:
    """The pid listening on a Unix socket (SO_PEERCRED), so --socket needs no --pid."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(2.0)
        s.connect(path)
        cred = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid: int = struct.unpack("3i", cred)[0]
        return pid or None
    except OSError:
        return None
    finally:
        s.close()


def wait_ready(sock: str, timeout_s: float, proc: subprocess.Popen[bytes] | None) -> None:
    deadline = time.monotonic() + timeout_s
    why = "socket not created"
    while True:
        if proc is not None and proc.poll() is not None:
            raise DaemonError(
                f"relayd serve exited with code {proc.returncode} before it was ready"
            )
        if os.path.exists(sock):
            why = _health(sock)
            if not why:
                return
        if time.monotonic() > deadline:
            raise DaemonError(f"daemon not ready after {timeout_s:.0f} s ({why})")
        time.sleep(0.05)


def _health(sock: str) -> str:
    """'' when the health service says SERVING, else why not."""
    try:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
    except ImportError:
        return _connectable(sock)
    try:
        with grpc.insecure_channel(f"unix:{sock}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
    except grpc.RpcError as exc:
        return f"health check: {exc.code().name}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"health: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return ""


def _connectable(sock: str) -> str:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(sock)
        return ""
    except OSError as exc:
        return f"connect: {exc}"
    finally:
        s.close()
