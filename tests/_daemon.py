"""The real daemon as a subprocess, for integration, fault and bench-smoke tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from relayd.launch import DaemonProcess, serve_argv
from relayd.peer_channel import NoticeListener
from tests import _zygote

READY_TIMEOUT = 30.0
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_PORTS_GIVEN: set[int] = set()
# Where a Mooncake engine's RPC listener takes a random port (MC_MIN_RPC_PORT..
# MC_MAX_RPC_PORT, by default; see relayd.transports.mooncake).
MOONCAKE_RPC_PORTS = range(15000, 17001)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, below the kernel's ephemeral range.

    ``bind(0)`` hands out an ephemeral port, and outgoing connections draw from
    the same range (Mooncake opens many): one took a daemon's metrics port
    between the test picking it and the daemon binding it. Below that range
    only the listeners the tests start compete, and each port is handed out once
    per process: two picks before either is bound (the two nodes of one test)
    would otherwise draw the same port now and then. Not in
    :data:`MOONCAKE_RPC_PORTS` either: a daemon's Mooncake engine took a port
    picked there for the next daemon's metrics before that daemon bound it.
    """
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 0
    for _ in range(200 if ephemeral_low > 11_000 else 0):
        port = random.randrange(10_000, ephemeral_low)
        if port in _PORTS_GIVEN or port in MOONCAKE_RPC_PORTS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _PORTS_GIVEN.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def hanging_port() -> Iterator[int]:
    """A loopback TCP port whose dials hang, unanswered: its listener's one-place
    accept queue is already full, so the kernel drops their SYNs."""
    with socket.socket() as listener, socket.socket() as filler:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        filler.connect(listener.getsockname())
        yield int(listener.getsockname()[1])


def wait_until(
    predicate: Any,
    timeout: float,
    what: str,
    interval: float = 0.02,
    state: Callable[[], object] | None = None,
) -> Any:
    """Poll ``predicate`` until truthy; fail with ``what`` after ``timeout`` seconds.

    ``state``: what the failure message shows of the system at the deadline
    (the numbers that tell a slow release from a leak).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            shown = "" if state is None else f"; state: {state()}"
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}{shown}")
        time.sleep(interval)


def reap(pid: int, timeout: float, what: str) -> int:
    """The exit code of child ``pid``, once it ends within ``timeout`` s (else it is
    killed, and the wait fails with ``what``)."""
    exit_code: list[int] = []

    def reaped() -> bool:
        child, status = os.waitpid(pid, os.WNOHANG)
        if child:
            exit_code.append(os.waitstatus_to_exitcode(status))
        return bool(child)

    try:
        wait_until(reaped, timeout, what)
    finally:
        if not exit_code:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return exit_code[0]


async def async_wait_until(
    predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.01
) -> Any:
    """:func:`wait_until` for a test on an event loop: the loop runs between polls."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def listener_reading(listener: NoticeListener, on: bool) -> None:
    """Pause or resume a peer notice listener's reads on every connection it holds:
    a peer that stops taking what it is sent, then takes it again."""
    for inbound in listener.conns:
        assert inbound.transport is not None
        if on:
            inbound.transport.resume_reading()
        else:
            inbound.transport.pause_reading()


class Daemon(DaemonProcess):
    """``relayd.launch.DaemonProcess`` with the tests' defaults and probes.

    ``args``, ``env``, ``socket`` and ``log_path`` may be changed before ``start()``
    (another uid's ``setpriv`` prefix, the embedded default socket).
    """

    def __init__(
        self,
        tmp: str,
        *args: str,
        pool: str = "64MiB",
        metrics: bool = False,
        env: dict[str, str] | None = None,
        node_id: str = "testnode",
    ) -> None:
        self.dir = tmp
        self.node_id = node_id
        self.metrics_port = free_port() if metrics else 0
        socket = os.path.join(tmp, "relayd.sock")
        if metrics:
            args = (*args, "--metrics-address", f"127.0.0.1:{self.metrics_port}")
        argv = serve_argv(
            socket,
            *args,
            # Unread test data should not hold a stopping daemon for the 10 s default.
            settings={"shm_pool_size": pool, "node_id": node_id, "drain_grace": 5},
        )
        super().__init__(
            socket,
            argv,
            env={**os.environ, **(env or {})},
            log_path=os.path.join(tmp, "daemon.log"),
        )
        self.epoch = ""

    @property
    def args(self) -> list[str]:
        return self.argv

    @args.setter
    def args(self, argv: list[str]) -> None:
        self.argv = argv

    def start(self, timeout_s: float = READY_TIMEOUT) -> Daemon:
        _DAEMONS.append(self.spawn())
        self.wait_serving(timeout_s)
        self.epoch = str(self.status()["daemon_epoch"])
        return self

    def log(self) -> str:
        return self.log_tail()

    def status(self) -> dict[str, Any]:
        from relayd.status_view import fetch_status, status_dict

        return status_dict(fetch_status(self.socket))

    def pool(self) -> dict[str, int]:
        p = self.status()["pools"][0]
        return {k: int(v) for k, v in p.items() if k != "name"}

    def scrape(self) -> str:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5
        ) as r:
            return str(r.read().decode())

    def segments(self) -> list[str]:
        """This daemon's own segments (other tests' daemons may share /dev/shm)."""
        prefix = f"relayd.{self.node_id}.{self.epoch}."
        return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        rc = super().stop(sig, timeout_s)
        if self.killed:
            raise AssertionError(f"relayd did not stop within {timeout_s}s:\n{self.log()}")
        return rc


@contextlib.contextmanager
def running_daemon(tmp: str, *args: str, **kw: Any) -> Iterator[Daemon]:
    d = Daemon(tmp, *args, **kw).start()
    try:
        yield d
    finally:
        if d.running():
            d.stop()


def run_worker(
    args: Sequence[str], *, input: bytes | None = None, timeout: float = 60.0, check: bool = True
) -> subprocess.CompletedProcess[bytes]:
    """Run ``python -m tests._workers ARGS`` in its own process."""
    cp = _zygote.run("tests._workers", args, cwd=REPO, input=input, timeout=timeout)
    if check and cp.returncode != 0:
        raise AssertionError(
            f"worker {args} failed ({cp.returncode}):\n{cp.stderr.decode()[-4000:]}"
        )
    return cp


_SPAWNED: list[subprocess.Popen[bytes]] = []
_DAEMONS: list[subprocess.Popen[bytes]] = []


def reap_workers() -> None:
    """Kill whatever a test left running and close its pipes (called after every test)."""
    while _DAEMONS:
        proc = _DAEMONS.pop()
        if proc.poll() is None:  # a test failed before stopping it
            proc.kill()
            proc.wait(timeout=10)
    while _SPAWNED:
        proc = _SPAWNED.pop()
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def _piped(argv: Sequence[str]) -> subprocess.Popen[bytes]:
    """``argv`` from the repository root with its three pipes, reaped after the test."""
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    _SPAWNED.append(proc)
    return proc


def spawn_worker(args: Sequence[str]) -> subprocess.Popen[bytes]:
    """``python -m tests._workers ARGS`` with its three pipes, reaped after the test."""
    proc = _zygote.popen("tests._workers", args, cwd=REPO)
    _SPAWNED.append(proc)
    return proc


def unshare_available() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    cp = subprocess.run(
        ["unshare", "--mount", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"],
        capture_output=True,
        timeout=30,
    )
    return cp.returncode == 0


def isolated_worker(args: Sequence[str]) -> subprocess.Popen[bytes]:
    """A worker in its own mount namespace with a private, empty /dev/shm (no hostIPC)."""
    inner = " ".join([sys.executable, "-m", "tests._workers", *args])
    return _piped(
        ["unshare", "--mount", "sh", "-c", f"mount -t tmpfs tmpfs /dev/shm && exec {inner}"]
    )


_PENDING: dict[int, bytes] = {}  # per worker pid: what was read past its last line


def read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """One line of a worker's stdout, or fail after ``timeout`` seconds. Reads the
    pipe unbuffered: a buffered reader could hold a line that select() won't see."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    buf = _PENDING.pop(proc.pid, b"")
    while b"\n" not in buf:
        ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            _PENDING[proc.pid] = buf
            raise TimeoutError(f"no output from worker within {timeout}s")
        chunk = os.read(fd, 65536)
        if not chunk:
            raise EOFError(f"worker exited with {proc.wait(timeout=10)}")
        buf += chunk
    line, _, _PENDING[proc.pid] = buf.partition(b"\n")
    return line.decode().strip()


def send_line(proc: subprocess.Popen[bytes], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line.encode() + b"\n")
    proc.stdin.flush()


@contextlib.contextmanager
def frozen(d: Daemon) -> Iterator[None]:
    """The daemon stopped, as on a stalled host: its sockets open, nothing answered."""
    os.kill(d.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(d.pid, signal.SIGCONT)


def kill9(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


def restarted(d: Daemon, where: str) -> Daemon:
    """``d`` killed (SIGKILL), and a new daemon started in ``where``, on the same socket."""
    assert d.proc is not None, "the daemon was never started"
    kill9(d.proc)
    return Daemon(where).start()


def lines(cp: subprocess.CompletedProcess[bytes]) -> list[str]:
    """A worker's stdout, one DataRef or digest per line."""
    return cp.stdout.decode().splitlines()


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from a Prometheus scrape (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def drained(d: Daemon) -> bool:
    """No bytes in leases and none granted: the arena is back to empty."""
    p = d.pool()
    return p.get("used_bytes", 0) == 0 and p.get("granted_bytes", 0) == 0
