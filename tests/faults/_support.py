"""Shared pieces of the fault tests: the victim zygote, process probes, leak checks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from tests._daemon import Daemon

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def unique_node() -> str:
    """A node id of our own: other suites' daemons share /dev/shm on this host."""
    return f"faults{secrets.token_hex(3)}"


def start_daemon(tmp: str, node: str, *args: str, pool: str = "128MiB", **kw: Any) -> Daemon:
    return Daemon(tmp, "--node-id", node, *args, pool=pool, **kw).start()


def node_segments(node: str) -> list[str]:
    prefix = f"relayd.{node}."
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


def foreign_segments(node: str, epoch: str) -> list[str]:
    """Segments of ``node`` that are not the live daemon's (leaked by a dead epoch)."""
    own = f"relayd.{node}.{epoch}."
    return [n for n in node_segments(node) if not n.startswith(own)]


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def leases(d: Daemon) -> list[dict[str, Any]]:
    return list(d.status().get("leases", []))


def quiet(d: Daemon) -> bool:
    """No lease, nothing granted, nothing used."""
    p = d.pool()
    return not leases(d) and p.get("used_bytes", 0) == 0 and p.get("granted_bytes", 0) == 0


def trend_ok(samples: list[float], slack: float, factor: float = 1.2) -> bool:
    """No growth trend: the last third's mean is within ``factor`` of the first third's."""
    if len(samples) < 6:
        return True
    k = len(samples) // 3
    first = sum(samples[:k]) / k
    last = sum(samples[-k:]) / k
    return last <= first * factor + slack


class Zygote:
    """Forks victim processes on demand (see tests/faults/_chaos.py)."""

    def __init__(self, socket: str, out_dir: str) -> None:
        self.out_dir = out_dir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.faults._chaos", "--socket", socket],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO,
        )
        self._n = 0
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != b"READY":
            raise RuntimeError(f"zygote did not start: {line!r}")

    def spawn(self, **cmd: Any) -> tuple[int, str]:
        """Fork one victim; returns (pid, path of its event file)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._n += 1
        out = os.path.join(self.out_dir, f"victim-{self._n}.log")
        open(out, "w").close()
        self.proc.stdin.write((json.dumps({**cmd, "out": out}) + "\n").encode())
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline()), out

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@contextlib.contextmanager
def zygote(socket: str, out_dir: str) -> Iterator[Zygote]:
    z = Zygote(socket, out_dir)
    try:
        yield z
    finally:
        z.close()


def lines(path: str) -> list[str]:
    with open(path) as fh:
        return [line.rstrip("\n") for line in fh]


async def wait_line(path: str, prefix: str, timeout: float) -> str | None:
    """The first line of ``path`` starting with ``prefix`` (or an error), polled until ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in lines(path):
            if line.startswith((prefix, "ERR")):
                return line
        await asyncio.sleep(0.01)
    return None


async def apoll(predicate: Any, timeout: float, what: str) -> None:
    """``wait_until`` for coroutines: polls without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


HEALTHY_SIZES = [20_000, 300_000, 1 << 20, 3 << 20]


class Healthy:
    """A writer/reader pair that keeps going while victims die around it.

    The writer attaches to ``writer_socket`` and the reader to
    ``reader_socket`` (the same daemon by default, another node's to make
    every read a cross-node pull); every payload is checked by digest.
    """

    def __init__(self, writer_socket: str, reader_socket: str | None = None) -> None:
        self.writer_socket = writer_socket
        self.reader_socket = reader_socket or writer_socket
        self.sent = 0
        self.verified = 0
        self.mismatched = 0
        self.errors: list[str] = []
        self.stop = asyncio.Event()

    async def run(self) -> None:
        from relayd_client import DataRef, RelayClient

        from tests._workers import digest, make_payload

        async with (
            RelayClient("healthy-w", self.writer_socket) as w,
            RelayClient("healthy-r", self.reader_socket) as r,
        ):
            i = 0
            while not self.stop.is_set():
                payload = make_payload(10_000 + i, HEALTHY_SIZES[i % len(HEALTHY_SIZES)])
                try:
                    ref = await w.put(payload, to_stage="healthy-r", request_id=f"h{i}", timeout=10)
                    self.sent += 1
                    got = await r.get(DataRef.from_bytes(ref.to_bytes()))
                except Exception as exc:  # any failure of the healthy pair fails the test
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    return
                if digest(got) == digest(payload):
                    self.verified += 1
                else:
                    self.mismatched += 1
                i += 1
                await asyncio.sleep(0)


def killed_by_kind(figures: dict[str, int]) -> dict[str, int]:
    """``killed_<role>`` counts of a chaos run, by role."""
    prefix = "killed_"
    return {k[len(prefix) :]: v for k, v in sorted(figures.items()) if k.startswith(prefix)}


def assert_survived(figures: dict[str, int], healthy: Healthy, min_kills: int) -> None:
    """A chaos run killed enough victims, the healthy pair verified every payload it
    moved, and every payload a victim published before dying was read back."""
    assert figures["kills"] >= min_kills
    assert not healthy.errors, healthy.errors
    assert healthy.mismatched == 0 and healthy.verified > 0
    assert figures["published_lost"] == 0
