"""``relayd top`` on a real terminal (a pty of 80x24) against a real daemon."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator

import pytest

from tests._daemon import Daemon, running_daemon, spawn_worker

pytestmark = pytest.mark.timeout(180)

CLEAR = "\x1b[H\x1b[2J"
ROWS, COLS = 24, 80


class Terminal:
    """``relayd top`` with a pty for its terminal; ``text`` is everything it wrote."""

    def __init__(self, d: Daemon, *args: str) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relayd", "top", "--socket", d.socket, "--interval", "0.2",
             *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
        )  # fmt: skip
        os.close(slave)
        self.master = master
        self.text = ""

    def read_until(self, done: Callable[[str], bool], timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while not done(self.text):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {what} within {timeout}s; terminal:\n{self.text[-3000:]}")
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:  # EIO: the other end is closed
                    chunk = b""
                if not chunk and self.proc.poll() is not None:
                    break
                self.text += chunk.decode(errors="replace").replace("\r", "")
        return self.text

    def frames(self) -> list[list[str]]:
        """Each complete redraw, as the lines it put on the screen."""
        parts = self.text.split(CLEAR)[1:-1]  # the last one may still be arriving
        return [p.rstrip("\n").split("\n") for p in parts]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        os.close(self.master)


@pytest.fixture
def busy(tmp_path: object) -> Iterator[Daemon]:
    """A daemon with more to show than 24 lines hold: six writers holding leases."""
    with running_daemon(str(tmp_path)) as d:
        writers = [
            spawn_worker(["write", "--socket", d.socket, "--stage", f"w{i}", "--to", "talker",
                          "--request", f"r{i}", "--hold"])
            for i in range(6)
        ]  # fmt: skip
        for w in writers:
            assert w.stdout is not None
            w.stdout.readline()
            assert w.stdout.readline().strip() == b"HOLDING"
        yield d


def test_top_keeps_its_header_on_80x24_and_quits_on_q(busy: Daemon) -> None:
    term = Terminal(busy)
    try:
        term.read_until(lambda t: t.count(CLEAR) >= 4, 60, "three full redraws")
        for frame in term.frames():
            assert frame[0] == "relayd top - every 0.2s", frame
            assert len(frame) <= ROWS - 1, frame  # never scrolls: the header stays on screen
            assert all(len(line) <= COLS for line in frame)
            assert frame[-1].startswith("... ") and "more lines" in frame[-1], frame
        assert any(line.startswith("EDGES") for line in term.frames()[-1])
        os.write(term.master, b"q")
        assert term.proc.wait(timeout=10) == 0
    finally:
        term.close()


def test_top_says_the_daemon_stopped_and_exits_without_a_traceback(tmp_path: object) -> None:
    with running_daemon(str(tmp_path)) as d:
        term = Terminal(d)
        try:
            term.read_until(lambda t: t.count(CLEAR) >= 2, 60, "a redraw")
            d.stop()
            text = term.read_until(lambda t: "stopped" in t, 30, "the daemon-stopped message")
            assert term.proc.wait(timeout=10) == 1
            assert f"relayd top: the daemon on {d.socket} stopped (UNAVAILABLE); exiting" in text
            assert "Traceback" not in text
        finally:
            term.close()


def test_top_without_a_terminal_prints_plain_frames(tmp_path: object) -> None:
    with running_daemon(str(tmp_path)) as d:
        cp = subprocess.run(
            [sys.executable, "-m", "relayd", "top", "--socket", d.socket, "--interval", "0.1",
             "--iterations", "2"],
            capture_output=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert cp.returncode == 0, cp.stderr.decode()
        out = cp.stdout.decode()
        assert CLEAR not in out and out.count("relayd top - every 0.1s") == 2
