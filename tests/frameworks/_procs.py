"""Worker processes that report JSON lines, read with a deadline."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

from tests._daemon import _SPAWNED

# What starts a report line; the frameworks log to stdout too.
REPORT = "@report"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Worker:
    """``python -m MODULE ARGS``: JSON lines from its stdout, stdin to nudge it."""

    def __init__(self, module: str, args: Sequence[str], log_path: str) -> None:
        self.log_path = log_path
        with open(log_path, "wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=ROOT,
            )
        _SPAWNED.append(self.proc)
        self._lines: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.seen: dict[str, Any] = {}
        self.records: list[dict[str, Any]] = []
        self._used: dict[str, int] = {}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(b"")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()[-6000:]

    def _more(self, key: str, timeout: float) -> None:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no {key!r} within {timeout}s:\n{self.log()}") from None
        if not line:
            raise AssertionError(
                f"worker exited ({self.proc.wait(10)}) before reporting {key!r}:\n{self.log()}"
            )
        if not line.startswith(REPORT.encode()):
            return
        record = json.loads(line[len(REPORT) :])
        self.records.append(record)
        for k, v in record.items():
            self.seen.setdefault(k, v)

    def expect(self, key: str, timeout: float = 120.0) -> Any:
        """The value of the first reported line holding ``key`` (earlier lines are kept)."""
        while key not in self.seen:
            self._more(key, timeout)
        return self.seen[key]

    def next_record(self, key: str, timeout: float = 120.0) -> dict[str, Any]:
        """The next reported line holding ``key`` that this method has not returned."""
        while True:
            found = [r for r in self.records if key in r]
            if len(found) > self._used.get(key, 0):
                self._used[key] = self._used.get(key, 0) + 1
                return found[self._used[key] - 1]
            self._more(key, timeout)

    def send(self, obj: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj).encode() + b"\n")
        self.proc.stdin.flush()

    def nudge(self) -> None:
        self.send({"go": True})

    def finish(self, timeout: float = 60.0) -> None:
        rc = self.proc.wait(timeout)
        assert rc == 0, f"worker exited with {rc}:\n{self.log()}"
