"""Parent side of a measurement: spawn a method's processes, watch them, collect their reports.

Every job gets fresh processes from the ``spawn`` context (a clean interpreter,
nothing inherited from the parent's heap or threads), as the reference runs did.
A pair job is a writer and a reader joined by a Unix socketpair per lane (see ``_child``);
a local job is one process. Several jobs can run at once (the stream workload):
their writers meet at a barrier so the streams start together.

Each child sends one report per size through its own pipe, or a ``ChildError``.
The parent never blocks on one child: it waits on all pipes with a short timeout,
redraws progress in between, enforces a deadline, and always reaps what it started.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.connection
import socket
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from relayd_bench import _netns
from relayd_bench._api import ChildError, JobSpec, ReaderReport, WriterReport
from relayd_bench._child import child_main
from relayd_bench._progress import Progress

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

ERROR_GRACE_S = 5.0  # after one side fails, how long the other gets to notice and exit
REAP_GRACE_S = 5.0
POLL_S = 0.2


@dataclasses.dataclass
class JobOutcome:
    spec: JobSpec
    writer: dict[tuple[str, int], WriterReport] = dataclasses.field(default_factory=dict)
    reader: dict[tuple[str, int], ReaderReport] = dataclasses.field(default_factory=dict)
    errors: list[ChildError] = dataclasses.field(default_factory=list)

    @property
    def error(self) -> ChildError | None:
        """The root cause: a peer's "socket closed" is only a consequence of the other's failure."""
        for e in self.errors:
            if "peer closed the socket" not in e.message:
                return e
        return self.errors[0] if self.errors else None

    def complete(self, method: str, size: int) -> bool:
        return (method, size) in self.writer and (method, size) in self.reader


ProgressText = Callable[[JobSpec, int, int, int, int], str]  # spec, step, size index, done, total


def run_jobs(
    specs: Sequence[JobSpec],
    *,
    local: bool,
    timeout_s: float,
    progress: Progress,
    describe: ProgressText,
) -> list[JobOutcome]:
    mp = multiprocessing.get_context("spawn")
    barrier = mp.Barrier(len(specs)) if len(specs) > 1 else None
    outcomes = [JobOutcome(spec) for spec in specs]
    procs: list[tuple[int, str, BaseProcess]] = []
    conns: dict[Connection, int] = {}
    counters: list[Any] = []
    try:
        for k, spec in enumerate(specs):
            counter = mp.RawArray("q", 4)
            counters.append(counter)
            pairs = [] if local else [_channel(spec) for _ in range(spec.lanes)]
            roles: list[tuple[str, list[socket.socket]]] = (
                [("local", [])]
                if local
                else [("writer", [w for w, _ in pairs]), ("reader", [r for _, r in pairs])]
            )
            for role, socks in roles:
                recv_end, send_end = mp.Pipe(duplex=False)
                p: BaseProcess = mp.Process(
                    target=child_main,
                    args=(
                        role,
                        spec,
                        socks,
                        send_end,
                        counter,
                        barrier if role != "reader" else None,
                    ),
                    name=f"relayd-bench-{role}",
                    daemon=True,
                )
                p.start()
                send_end.close()  # so the pipe reports EOF when the child exits
                procs.append((k, role, p))
                conns[recv_end] = k
            for pair in pairs:
                for s in pair:
                    s.close()  # the children hold their own copies now
        _watch(outcomes, conns, counters, barrier, timeout_s, progress, describe)
    finally:
        _reap([p for _, _, p in procs])
    for k, role, p in procs:
        if p.exitcode not in (0, None) and not outcomes[k].errors:
            outcomes[k].errors.append(
                ChildError(role, None, None, f"{role} process exited with code {p.exitcode}", "")
            )
    return outcomes


def _channel(spec: JobSpec) -> tuple[socket.socket, socket.socket]:
    """Writer's and reader's ends of one lane's channel that carries notifies (DataRefs).

    With namespaces (``--netns``) it is a TCP connection across the veth link, as an
    application's channel between two hosts would be; otherwise a Unix socketpair.
    """
    ns = spec.ctx.netns
    if ns is None:
        return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return _netns.tcp_pair(ns, spec.ctx.hosts[0])


def _watch(
    outcomes: list[JobOutcome],
    conns: dict[Connection, int],
    counters: list[Any],
    barrier: Any,
    timeout_s: float,
    progress: Progress,
    describe: ProgressText,
) -> None:
    deadline = time.monotonic() + timeout_s
    failed = False
    while conns:
        for c in multiprocessing.connection.wait(list(conns), timeout=POLL_S):
            assert isinstance(c, multiprocessing.connection.Connection)
            outcome = outcomes[conns[c]]
            try:
                msg = c.recv()
            except (EOFError, OSError):
                del conns[c]
                c.close()
                continue
            if isinstance(msg, WriterReport):
                outcome.writer[msg.method, msg.size] = msg
            elif isinstance(msg, ReaderReport):
                outcome.reader[msg.method, msg.size] = msg
            elif isinstance(msg, ChildError):
                outcome.errors.append(msg)
                failed = True
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
                if barrier is not None:
                    barrier.abort()  # streams still waiting to start give up at once
        counter = counters[0]
        spec = outcomes[0].spec
        if counter[3]:
            progress.update(describe(spec, counter[0], counter[1], counter[2], counter[3]))
        if time.monotonic() > deadline:
            why = (
                "stopped: another process failed"
                if failed
                else f"timed out after {timeout_s:.0f} s"
            )
            for o in outcomes:
                if not o.errors:
                    o.errors.append(ChildError("harness", None, None, why, ""))
            for c in conns:
                c.close()
            return


def _reap(procs: list[BaseProcess]) -> None:
    """Join; what is still running after a shared grace period gets SIGTERM, then SIGKILL."""
    end = time.monotonic() + REAP_GRACE_S
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()  # children turn SIGTERM into an exit that still runs teardown
    end = time.monotonic() + REAP_GRACE_S
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
