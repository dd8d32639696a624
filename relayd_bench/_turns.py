"""The daemon's side of ``relayd bench --breakdown``: what each turn on a session frame costs it.

The breakdown starts its daemon through this module::

    python -m relayd_bench._turns OUT  python -m relayd serve --socket ...

which wraps the steps of the daemon's turn on a client's frames
(:meth:`relayd.rpc.session.SessionProtocol.data_received`) with thread-CPU
timers, then runs relayd as the rest of the command line says. When the
daemon exits it writes one JSON line per turn to OUT: when the turn ended
(``time.monotonic_ns``, one clock for every process of the host) and the CPU
each step took. The daemon carries no instrumentation of its own; here each
timer costs a thread-CPU clock read (a system call, ~0.5 us), inside the turn.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from relayd_bench._timeline import wrapper_args

# (row label, the step: a method of SessionProtocol, or the module's decode_frame)
STEPS: tuple[tuple[str, str], ...] = (
    ("decode the frames", "decode_frame"),
    ("notices: reserve, publish, claim, release, ...", "_handle"),
    ("count their transfers", "_count"),
    ("take the Release rings", "_take_releases"),
    ("send Freed", "_flush"),
)
TURN = "turn"  # the whole of data_received
END = "end"  # monotonic ns when the turn ended
# What Window.summary adds to the steps' medians.
PER_TRANSFER = "per_transfer"  # turns per transfer
CPU_PER_TRANSFER = "cpu_per_transfer"  # the turns' CPU per transfer, µs


def install(record: list[dict[str, int]]) -> None:
    """Wrap the steps in this process's relayd; each turn appends its row to ``record``."""
    from relayd.rpc import session

    cls: Any = session.SessionProtocol
    clock = time.thread_time_ns
    current: dict[str, int] = {}

    def timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def step(*a: Any, **kw: Any) -> Any:
            t0 = clock()
            try:
                return fn(*a, **kw)
            finally:
                current[key] = current.get(key, 0) + clock() - t0

        return step

    for _, where in STEPS:
        owner: Any = session if where == "decode_frame" else cls
        setattr(owner, where, timed(where, getattr(owner, where)))
    turn = cls.data_received

    def data_received(self: Any, data: bytes) -> None:
        current.clear()
        t0 = clock()
        try:
            turn(self, data)
        finally:
            current[TURN] = clock() - t0
            current[END] = time.monotonic_ns()
            record.append(dict(current))

    cls.data_received = data_received


def main(argv: Sequence[str] | None = None) -> int:
    """``OUT python -m relayd ARGS...``: run relayd with the timers, write OUT at exit."""
    out, args = wrapper_args("relayd_bench._turns", argv)
    record: list[dict[str, int]] = []
    install(record)
    from relayd.cli import main as relayd_main

    try:
        return relayd_main(args)
    finally:
        out.write_text("".join(json.dumps(row) + "\n" for row in record))


def read(path: Path) -> list[dict[str, int]]:
    """The turns a daemon started through :func:`main` wrote; none if it wrote nothing."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line]


class Window:
    """The turns that ended while ``transfers`` transfers ran, from ``start`` to ``end``."""

    def __init__(self, start_ns: int, end_ns: int, transfers: int) -> None:
        self.start_ns, self.end_ns, self.transfers = start_ns, end_ns, transfers

    def summary(self, turns: Iterable[dict[str, int]]) -> dict[str, float | None]:
        """Per step, its median per turn (µs); the turns per transfer; the turns'
        CPU per transfer (µs, exact: their sum over the transfers)."""
        mine = [t for t in turns if self.start_ns <= t[END] <= self.end_ns]
        out: dict[str, float | None] = {}
        for key in [TURN, *(where for _, where in STEPS)]:
            values = [t.get(key, 0) for t in mine]
            out[key] = statistics.median(values) / 1000 if values else None
        n = max(self.transfers, 1)
        out[PER_TRANSFER] = len(mine) / n
        out[CPU_PER_TRANSFER] = sum(t[TURN] for t in mine) / n / 1000
        return out


if __name__ == "__main__":
    raise SystemExit(main())
