"""``relayd bench --timeline``: where a cross-node transfer's time goes, hop by hop.

A relayd-mooncake transfer crosses four processes: the writer, its daemon, the
reader's daemon and the reader. ``--breakdown`` times one process's steps; this
times the whole path. Each process stamps named steps (:data:`CLIENT_PROBES`,
:data:`DAEMON_PROBES`) with ``time.monotonic_ns``, one clock for every process
of the host, into its own file; afterwards every transfer is cut out by the
writer's put that starts it (the bench's transfers are stop-and-wait), and the
table gives each step's median offset from that put and the median hop from
the step before it.

Neither relayd nor its client carries a probe: :func:`install` wraps the named
functions in the daemons (started through ``python -m relayd_bench._timeline DIR
python -m relayd serve ...``) and in the bench's writers and readers (when their
``BenchContext.timeline`` names a directory). A step is the start or the end of
such a call. A probe costs a clock read and a line written (~2 µs here), so the
timed medians run above an untimed run's.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import importlib
import inspect
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

WRITER, WRITER_DAEMON, READER_DAEMON, READER = (
    "writer",
    "writer's daemon",
    "reader's daemon",
    "reader",
)
DAEMON = "daemon"  # a daemon's marks, whose side the analysis decides
ANCHOR = "put starts"  # the writer's mark that starts a transfer
_SUFFIX = ".tl"


@dataclasses.dataclass(frozen=True)
class Probe:
    module: str
    attr: str  # "Class.method" or "function"
    enter: str  # the step the call's start stamps
    leave: str = ""  # the step its end stamps, if any


# The writer's and the reader's probes go into the bench's children, the daemons'
# into both daemons (a daemon's side is told by what it did: see _read).
CLIENT_PROBES = (
    Probe("relayd_client._client", "RelayClient.put", ANCHOR, "put returns"),
    Probe("relayd_client._session", "SessionChannel._write_bytes", "session frame written"),
    Probe("relayd_client._client", "RelayClient.get", "get starts", "get returns"),
    Probe("relayd_client._reader", "Reader._fetch", "fetch call", "fetch answered"),
    # The reader's wake-up, then its frame decoded, apart: each is a hop of its own.
    Probe("relayd_client._session", "_Frames.data_received", "daemon's bytes read"),
    Probe("relayd_client._client", "RelayClient._on_frame", "session frame read"),
    Probe(
        "relayd_client._reader",
        "Reader._answer_from_announcement",
        "announcement handled",
        "answered from it",
    ),
    Probe("relayd_client._reader", "Reader.read_region", "copying out", "copied out"),
    # The blocking client's own put and get, and its wait for an announcement on
    # the caller's thread (which reads the announcement socket meanwhile).
    Probe("relayd_client._sync", "SyncRelayClient.put", ANCHOR, "put returns"),
    Probe("relayd_client._sync", "SyncRelayClient.get", "get starts", "get returns"),
    Probe(
        "relayd_client._reader", "Reader._await_announced", "waits for the landing", "done waiting"
    ),
    Probe("relayd_client._session", "SessionChannel._send_from_thread", "session frame written"),
    Probe("relayd_client._remote", "Announced.add", "announcement heard"),
    Probe("relayd_client._reader", "Reader.end_read", "header re-check", "release noted"),
)
DAEMON_PROBES = (
    Probe("relayd.rpc.session", "SessionProtocol.data_received", "session frame read"),
    Probe("relayd.rpc.session", "SessionProtocol.send", "session frame written"),
    Probe("relayd.push", "PushManager.on_publish", "push starts"),
    Probe(
        "relayd.peer_notices", "PeerNotifier.send_attached", "sending bytes", "bytes handed over"
    ),
    Probe("relayd.push", "PushManager._push", "Mooncake WRITE", "Mooncake WRITE done"),
    Probe("relayd.peer_channel", "_Inbound.buffer_updated", "notice bytes read"),
    Probe("relayd.push", "PushManager.on_notices", "handling notices"),
    Probe("relayd.push_landing", "PushLanding._announce", "announcing the landing"),
)
_WRITER_DAEMON_STEP = "push starts"


class _Marks:
    def __init__(self, out: TextIO) -> None:
        self.out = out

    def mark(self, step: str) -> None:
        self.out.write(f"{time.monotonic_ns()} {step}\n")

    def close(self) -> None:
        self.out.close()


def _wrapped(fn: Callable[..., Any], marks: _Marks, probe: Probe) -> Callable[..., Any]:
    enter, leave = probe.enter, probe.leave
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def timed_async(*a: Any, **kw: Any) -> Any:
            marks.mark(enter)
            try:
                return await fn(*a, **kw)
            finally:
                if leave:
                    marks.mark(leave)

        return timed_async

    @functools.wraps(fn)
    def timed(*a: Any, **kw: Any) -> Any:
        marks.mark(enter)
        try:
            return fn(*a, **kw)
        finally:
            if leave:
                marks.mark(leave)

    return timed


def install(
    out_dir: Path, probes: Sequence[Probe], side: str, job: str = "", skip: int = 0
) -> _Marks:
    """Wrap ``probes`` in this process; its marks go to a file of ``out_dir``, headed by
    its side, its job (a writer's or reader's: the method and size) and the transfers
    its job warms up with (``skip``). The file stays open while the process lives."""
    out = (out_dir / f"{os.getpid()}{_SUFFIX}").open("a", buffering=1)
    out.write(f"# {side}\t{job}\t{skip}\n")
    marks = _Marks(out)
    for probe in probes:
        owner: Any = importlib.import_module(probe.module)
        *path, name = probe.attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, name, _wrapped(getattr(owner, name), marks, probe))
    return marks


def daemon_prefix(out_dir: Path) -> list[str]:
    """What starts a daemon through the probes (``_daemon.start_pair``'s ``prefix``)."""
    return wrapper_prefix("relayd_bench._timeline", out_dir)


def wrapper_prefix(module: str, out: Path) -> list[str]:
    """What starts a daemon through the wrapper ``module`` writing to ``out``
    (``_daemon.start``'s ``prefix``); the wrapper reads it with :func:`wrapper_args`."""
    return [sys.executable, "-m", module, str(out)]


def wrapper_args(module: str, argv: Sequence[str] | None) -> tuple[Path, list[str]]:
    """A daemon wrapper's command line, ``OUT python -m relayd ARGS...``: OUT and ARGS."""
    args = list(sys.argv[1:] if argv is None else argv)
    out, command = Path(args[0]), args[1:]
    if command[1:3] != ["-m", "relayd"]:
        raise SystemExit(f"usage: python -m {module} OUT python -m relayd ...; got {command}")
    return out, command[3:]


def main(argv: Sequence[str] | None = None) -> int:
    """``DIR python -m relayd ARGS...``: run relayd with the daemon's probes."""
    out, args = wrapper_args("relayd_bench._timeline", argv)
    install(out, DAEMON_PROBES, DAEMON)
    from relayd.cli import main as relayd_main

    return relayd_main(args)


# -- the table --------------------------------------------------------------------------

Mark = tuple[int, str, str]  # monotonic ns, side, step


@dataclasses.dataclass
class _File:
    side: str
    job: str
    skip: int
    marks: list[tuple[int, str]]


def _read(path: Path) -> _File:
    head, _, body = path.read_text().partition("\n")
    side, job, skip = head.removeprefix("# ").split("\t")
    marks = []
    for line in body.splitlines():
        ns, _, step = line.partition(" ")
        if step:
            marks.append((int(ns), step))
    if side == DAEMON:
        pushed = any(step == _WRITER_DAEMON_STEP for _, step in marks)
        side = WRITER_DAEMON if pushed else READER_DAEMON
    return _File(side, job, int(skip), marks)


@dataclasses.dataclass
class Step:
    side: str
    step: str
    at_us: float  # median offset from the transfer's put
    hop_us: float | None  # median from the step before it in the table
    seen: int  # transfers it was seen in


def steps(marks: Sequence[Mark], skip: int = 0) -> tuple[list[Step], int]:
    """The table's rows, ordered by median offset, and the transfers they cover (each
    cut from one put of the writer to the next; the first ``skip`` are warm-up).
    Within a transfer a step counts once, at its first mark."""
    times = [m[0] for m in marks]
    anchors = [ns for ns, side, step in marks if side == WRITER and step == ANCHOR][skip:]
    firsts: list[dict[tuple[str, str], int]] = []
    for start, end in itertools.pairwise(anchors):
        seen: dict[tuple[str, str], int] = {}
        lo, hi = bisect.bisect_left(times, start), bisect.bisect_left(times, end)
        for ns, side, step in marks[lo:hi]:
            seen.setdefault((side, step), ns - start)
        firsts.append(seen)
    offsets: dict[tuple[str, str], list[int]] = {}
    for seen in firsts:
        for key, ns in seen.items():
            offsets.setdefault(key, []).append(ns)
    order = sorted(offsets, key=lambda k: statistics.median(offsets[k]))
    rows: list[Step] = []
    for i, key in enumerate(order):
        hop = None
        if i:
            prev = order[i - 1]
            gaps = [s[key] - s[prev] for s in firsts if key in s and prev in s]
            hop = statistics.median(gaps) / 1000 if gaps else None
        rows.append(Step(*key, statistics.median(offsets[key]) / 1000, hop, len(offsets[key])))
    return rows, len(firsts)


def render(title: str, rows: Sequence[Step], transfers: int) -> str:
    lines = [
        f"{title}: median µs from the writer's put (at) and from the step above (hop), "
        f"over {transfers} transfers; a step counts at its first mark in a transfer",
        f"{'process':<16} {'step':<22} {'at':>8} {'hop':>8}  seen in",
    ]
    for r in rows:
        hop = "" if r.hop_us is None else f"{r.hop_us:8.1f}"
        share = r.seen * 100 // max(transfers, 1)
        lines.append(f"{r.side:<16} {r.step:<22} {r.at_us:8.1f} {hop:>8}  {share}%")
    return "\n".join(lines) + "\n"


def report(out_dir: Path) -> str:
    """A table per writer's job in ``out_dir`` (its reader's marks, and the daemons'
    while it ran), in the order the jobs ran; "" when no writer stamped a put."""
    files = [_read(p) for p in sorted(out_dir.glob(f"*{_SUFFIX}"))]
    writers = sorted((f for f in files if f.side == WRITER and f.marks), key=lambda f: f.marks[0])
    daemons = [f for f in files if f.side in (WRITER_DAEMON, READER_DAEMON)]
    tables = []
    for w in writers:
        start, end = w.marks[0][0], w.marks[-1][0]
        marks: list[Mark] = [(ns, WRITER, step) for ns, step in w.marks]
        for f in files:
            if f.side == READER and f.job == w.job:
                marks += [(ns, READER, step) for ns, step in f.marks]
        for d in daemons:
            marks += [(ns, d.side, step) for ns, step in d.marks if start <= ns <= end]
        marks.sort()
        rows, transfers = steps(marks, w.skip)
        tables.append(render(f"timeline, {w.job}", rows, transfers))
    return "\n".join(tables)


if __name__ == "__main__":
    raise SystemExit(main())
