"""What runs inside a benchmark process: the stop-and-wait loops around a method's hooks.

Timed region: the writer stamps ``t0 = perf_counter_ns()`` before ``send(i)``; the
reader stamps ``t1`` when ``recv`` returns; ``t1 - t0`` is the one-way sample
(CLOCK_MONOTONIC is the same clock in every process). A method with a
``handoff_delay_s`` sends the DataRef that long after ``send(i)`` and stamps
``t0`` then: the sample is the read of a DataRef that came after its bytes. The
writer also stamps when ``send`` returned and the reader when the frame was in,
so each sample splits into its :data:`~relayd_bench._api.Parts`. A local method
is timed around ``transfer(i)``. In a paced job (the stream workload) the writer sleeps
until each transfer is due and stamps the real start, so sleep overshoot does not
count; if it is already behind, ``t0`` is the due time, so queueing delay does.

CPU time and minor faults come from ``getrusage`` over the measured transfers;
the daemon's CPU and wake-ups from procfs, sampled by the writer (or local
process), and for a step whose reader has its own daemon (relayd-mooncake) that
daemon's as well.

A process that carries several streams (``JobSpec.lanes``) runs these loops once
per lane: tasks on one event loop for a coroutine method, threads for a blocking
one (see ``_lanes``). Only lane 0 samples the daemons and shows progress.

The parent imports this module only to name ``child_main``; torch is imported in
the child, as it costs ~2 s of CPU per import here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib
import resource
import signal
import socket
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from relayd_bench import _netns, _timeline
from relayd_bench import _wire as wire
from relayd_bench._api import (
    METHOD_BASES,
    AnyMethod,
    AsyncLocalMethod,
    AsyncPairMethod,
    ChildError,
    JobSpec,
    LocalMethod,
    Pace,
    PairMethod,
    Parts,
    ReaderReport,
    SizePlan,
    Step,
    Usage,
    WriterReport,
)
from relayd_bench._lanes import Reports, Start, in_threads
from relayd_bench._payload import MIN_SIZE, Stamp, check_tensor, make_source
from relayd_bench._procstat import ProcSample, proc_sample
from relayd_bench._table import fmt_size
from relayd_bench._wire import BenchFailure

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.synchronize import Barrier

ROLE_NODE = {"writer": 0, "reader": 1}  # with --netns: which namespace each role runs in


def load_target(target: str) -> type[AnyMethod]:
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, METHOD_BASES)):
        raise TypeError(f"{target} is not a benchmark method class")
    return cls


def _usage() -> tuple[int, int]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return round((ru.ru_utime + ru.ru_stime) * 1e9), ru.ru_minflt


class _Meter:
    """Per-size bookkeeping, all outside the timed region."""

    def __init__(
        self, run: _Run, plan: SizePlan, *, daemon: bool, own: tuple[int, int] | None = None
    ) -> None:
        spec, step = run.spec, run.step
        self._step, self._plan = step, plan
        measure = daemon and spec.measure_daemon and run.lane == 0
        self._pid = spec.ctx.daemon_pid if measure else None
        self._reader_pid = spec.ctx.reader_daemon_pid if measure and step.reader_daemon else None
        if measure and own is not None and spec.pace is None:
            # A method's own stand-ins serve its pair alone: per transfer only
            # where every transfer is this pair's (not a stream of many pairs).
            self._pid, self._reader_pid = own
        self.samples: list[int] = []
        self.parts: list[Parts] = []
        self.start_ns = 0
        self._u0, self._d0, self._r0 = _usage(), self._daemon(), self._reader_daemon()

    def _daemon(self) -> ProcSample | None:
        return None if self._pid is None else proc_sample(self._pid)

    def _reader_daemon(self) -> ProcSample | None:
        return None if self._reader_pid is None else proc_sample(self._reader_pid)

    def at(self, i: int) -> None:
        if i == self._plan.warmup:  # warm-up over: resources count from here
            self._u0, self._d0, self._r0 = _usage(), self._daemon(), self._reader_daemon()

    def record(self, i: int, sample_ns: int, start_ns: int) -> None:
        if i >= self._plan.warmup:
            if i == self._plan.warmup:
                self.start_ns = start_ns
            self.samples.append(sample_ns)

    def record_read(self, i: int, frame: wire.Frame, arrived_ns: int, done_ns: int) -> None:
        """A reader's sample, ``done - t0``, and its :data:`Parts`."""
        self.record(i, done_ns - frame.t0, frame.t0)
        if i >= self._plan.warmup:
            self.parts.append(
                (frame.sent - frame.t0, arrived_ns - frame.sent, done_ns - arrived_ns)
            )

    def _delta(self) -> Usage:
        cpu, flt = _usage()
        return Usage(cpu - self._u0[0], flt - self._u0[1])

    def writer_report(self, extra: dict[str, str]) -> WriterReport:
        end_ns, usage = time.perf_counter_ns(), self._delta()
        d1, r1 = self._daemon(), self._reader_daemon()
        return WriterReport(
            self._step.method,
            self._plan.size,
            usage,
            tuple(self.samples),
            _since(self._d0, d1),
            _since(self._r0, r1),
            self.start_ns,
            end_ns,
            dict(extra),
        )

    def reader_report(
        self, *, local: bool = False, extra: dict[str, str] | None = None
    ) -> ReaderReport:
        usage = Usage(0, 0) if local else self._delta()  # a local process reports as writer
        samples, parts = tuple(self.samples), tuple(self.parts)
        return ReaderReport(
            self._step.method, self._plan.size, usage, samples, dict(extra or {}), parts
        )


def _since(start: ProcSample | None, end: ProcSample | None) -> ProcSample | None:
    return end - start if start is not None and end is not None else None


class _Schedule:
    def __init__(self, pace: Pace | None, lane: int, base_ns: int) -> None:
        self._pace = pace
        self._base = base_ns + (pace.due_offset_ns(lane) if pace is not None else 0)

    def _due(self, i: int) -> int | None:
        if self._pace is None:
            return None
        return self._base + i * self._pace.period_ns

    def wait(self, i: int) -> int | None:
        """Sleep until transfer i is due; the due time if already late (it becomes t0)."""
        due = self._due(i)
        if due is None or time.perf_counter_ns() >= due:
            return due
        while (left := due - time.perf_counter_ns()) > 0:
            time.sleep(left / 1e9)
        return None

    async def await_(self, i: int) -> int | None:
        due = self._due(i)
        if due is None or time.perf_counter_ns() >= due:
            return due
        while (left := due - time.perf_counter_ns()) > 0:
            await asyncio.sleep(left / 1e9)
        return None


@dataclasses.dataclass
class _Run:
    """What every loop needs besides the method: where it is, and where reports go."""

    spec: JobSpec
    step: Step
    reports: Reports
    progress: Any  # RawArray("q", 4): step index, size index, done, total
    begin: Start
    step_index: int = 0
    lane: int = 0
    size: int | None = None  # for the error report

    def start(self, index: int, plan: SizePlan) -> None:
        self.size = plan.size
        if self.lane == 0:  # lane 0 speaks for the process's progress
            p = self.progress
            p[0], p[1], p[2], p[3] = self.step_index, index, 0, plan.warmup + plan.iterations

    def done(self, n: int) -> None:
        if self.lane == 0:
            self.progress[2] = n

    def report(self, r: WriterReport | ReaderReport) -> None:
        self.reports.send(self.lane, r)


def _writer(m: PairMethod, run: _Run, sock: socket.socket) -> None:
    for index, plan in enumerate(run.step.sizes):
        run.start(index, plan)
        source = make_source(plan.size)
        stamp = Stamp(source)
        wire.send_frame(sock, 0, m.setup_writer(plan.size, source))
        wire.expect(sock, wire.READY)
        m.start_writer()
        sched = _Schedule(run.spec.pace, run.lane, run.begin.wait())
        meter = _Meter(run, plan, daemon=True, own=m.daemon_pids())
        for i in range(plan.warmup + plan.iterations):
            meter.at(i)
            late = sched.wait(i)
            stamp(i)
            t0 = time.perf_counter_ns()
            payload = m.send(i)
            sent = time.perf_counter_ns()
            if m.handoff_delay_s:
                time.sleep(m.handoff_delay_s)
                t0 = sent = time.perf_counter_ns()
            wire.send_frame(sock, t0 if late is None else late, payload, sent)
            wire.expect(sock, wire.ACK)
            meter.record(i, time.perf_counter_ns() - t0, t0 if late is None else late)
            run.done(i + 1)
        m.finish_writer()
        report = meter.writer_report(m.extra)
        m.teardown_writer()
        run.report(report)
    wire.send_end(sock)


def _reader(m: PairMethod, run: _Run, sock: socket.socket) -> None:
    rx = wire.Receiver(sock)
    for plan in run.step.sizes:
        run.size = plan.size
        m.setup_reader(plan.size, bytes(rx.frame().body))
        sock.sendall(wire.READY)
        meter = _Meter(run, plan, daemon=False)
        for i in range(plan.warmup + plan.iterations):
            meter.at(i)
            frame = rx.frame()
            arrived = time.perf_counter_ns()
            tensor = m.recv(frame.body)
            meter.record_read(i, frame, arrived, time.perf_counter_ns())
            check_tensor(tensor, plan.size, i)
            del tensor, frame  # a view must be gone before cleanup releases its memory
            m.cleanup()
            sock.sendall(wire.ACK)
        report = meter.reader_report(extra=m.extra)
        m.teardown_reader()
        run.report(report)
    rx.expect_end()


def _local(m: LocalMethod, run: _Run) -> None:
    for index, plan in enumerate(run.step.sizes):
        run.start(index, plan)
        source = make_source(plan.size)
        stamp = Stamp(source)
        m.setup(plan.size, source)
        meter = _Meter(run, plan, daemon=True)
        total = plan.warmup + plan.iterations
        for i in range(total):
            meter.at(i)
            stamp(i)
            t0 = time.perf_counter_ns()
            tensor = m.transfer(i)
            meter.record(i, time.perf_counter_ns() - t0, t0)
            check_tensor(tensor, plan.size, i)
            del tensor
            m.cleanup()
            if i % 64 == 0 or i == total - 1:
                run.done(i + 1)  # a hot copy takes ~1 µs: keep even this off most iterations
        reports = meter.writer_report(m.extra), meter.reader_report(local=True)
        m.teardown()
        for r in reports:
            run.report(r)


async def _awriter(m: AsyncPairMethod, run: _Run, sock: socket.socket) -> None:
    for index, plan in enumerate(run.step.sizes):
        run.start(index, plan)
        source = make_source(plan.size)
        stamp = Stamp(source)
        await wire.asend_frame(sock, 0, await m.setup_writer(plan.size, source))
        await wire.aexpect(sock, wire.READY)
        await m.start_writer()
        sched = _Schedule(run.spec.pace, run.lane, await run.begin.await_())
        meter = _Meter(run, plan, daemon=True, own=m.daemon_pids())
        for i in range(plan.warmup + plan.iterations):
            meter.at(i)
            late = await sched.await_(i)
            stamp(i)
            t0 = time.perf_counter_ns()
            payload = await m.send(i)
            sent = time.perf_counter_ns()
            if m.handoff_delay_s:
                await asyncio.sleep(m.handoff_delay_s)
                t0 = sent = time.perf_counter_ns()
            await wire.asend_frame(sock, t0 if late is None else late, payload, sent)
            await wire.aexpect(sock, wire.ACK)
            meter.record(i, time.perf_counter_ns() - t0, t0 if late is None else late)
            run.done(i + 1)
        await m.finish_writer()
        report = meter.writer_report(m.extra)
        await m.teardown_writer()
        run.report(report)
    await wire.asend_end(sock)


async def _areader(m: AsyncPairMethod, run: _Run, sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    rx = wire.Receiver(sock)
    for plan in run.step.sizes:
        run.size = plan.size
        await m.setup_reader(plan.size, bytes((await rx.aframe()).body))
        await loop.sock_sendall(sock, wire.READY)
        meter = _Meter(run, plan, daemon=False)
        for i in range(plan.warmup + plan.iterations):
            meter.at(i)
            frame = await rx.aframe()
            arrived = time.perf_counter_ns()
            tensor = await m.recv(frame.body)
            meter.record_read(i, frame, arrived, time.perf_counter_ns())
            check_tensor(tensor, plan.size, i)
            del tensor, frame
            await m.cleanup()
            await loop.sock_sendall(sock, wire.ACK)
        report = meter.reader_report(extra=m.extra)
        await m.teardown_reader()
        run.report(report)
    await rx.aexpect_end()


async def _alocal(m: AsyncLocalMethod, run: _Run) -> None:
    for index, plan in enumerate(run.step.sizes):
        run.start(index, plan)
        source = make_source(plan.size)
        stamp = Stamp(source)
        await m.setup(plan.size, source)
        meter = _Meter(run, plan, daemon=True)
        for i in range(plan.warmup + plan.iterations):
            meter.at(i)
            stamp(i)
            t0 = time.perf_counter_ns()
            tensor = await m.transfer(i)
            meter.record(i, time.perf_counter_ns() - t0, t0)
            check_tensor(tensor, plan.size, i)
            del tensor
            await m.cleanup()
            run.done(i + 1)
        reports = meter.writer_report(m.extra), meter.reader_report(local=True)
        await m.teardown()
        for r in reports:
            run.report(r)


def _dispatch(
    role: str, methods: Sequence[AnyMethod], runs: Sequence[_Run], socks: Sequence[socket.socket]
) -> None:
    m, run = methods[0], runs[0]
    lanes = list(zip(methods, runs, socks, strict=True)) if socks else []
    if isinstance(m, LocalMethod) and role == "local":
        _local(m, run)
    elif isinstance(m, AsyncLocalMethod) and role == "local":
        asyncio.run(_alocal(m, run))
    elif isinstance(m, PairMethod) and lanes:
        loop = _writer if role == "writer" else _reader
        for sock in socks:
            sock.setblocking(True)
        in_threads([functools.partial(loop, lm, lr, ls) for lm, lr, ls in lanes])  # type: ignore[arg-type]
    elif isinstance(m, AsyncPairMethod) and lanes:
        aloop = _awriter if role == "writer" else _areader
        for sock in socks:
            sock.setblocking(False)  # the event loop's sock_* calls need it

        async def together() -> None:
            await asyncio.gather(*(aloop(lm, lr, ls) for lm, lr, ls in lanes))  # type: ignore[arg-type]

        asyncio.run(together())
    else:
        raise TypeError(f"{run.step.target} cannot run as {role}")


def _teardown(role: str, m: AnyMethod) -> None:
    """After a failure the loop's own teardown was skipped: still unlink what was made."""
    if isinstance(m, LocalMethod):
        m.teardown()
    elif isinstance(m, AsyncLocalMethod):
        asyncio.run(m.teardown())
    elif isinstance(m, PairMethod):
        if role == "writer":
            m.teardown_writer()
        else:
            m.teardown_reader()
    elif role == "writer":
        asyncio.run(m.teardown_writer())
    else:
        asyncio.run(m.teardown_reader())


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def child_main(
    role: str,
    spec: JobSpec,
    socks: list[socket.socket],
    conn: Connection,
    progress: Any,
    barrier: Barrier | None,
) -> None:
    """Entry point of every benchmark process (spawned: a clean interpreter each time).

    ``socks``: one channel per lane for a writer or reader, none for a local process.
    """
    # the parent ends a stuck job with SIGTERM: unwind, so teardown still runs
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    run: _Run | None = None
    try:
        if spec.ctx.netns is not None and role in ROLE_NODE:
            _netns.enter(spec.ctx.netns[ROLE_NODE[role]])  # before any engine opens a socket
        import torch

        torch.set_num_threads(1)  # as in the reference runs: one core per process
        if spec.ctx.timeline is not None and role in (_timeline.WRITER, _timeline.READER):
            first = spec.steps[0]
            plan = first.sizes[0]
            job = f"{first.method}, {fmt_size(plan.size)}"
            probes = _timeline.CLIENT_PROBES
            _timeline.install(Path(spec.ctx.timeline), probes, role, job, plan.warmup)
        for step in spec.steps:
            if any(p.size < MIN_SIZE or p.iterations < 1 for p in step.sizes):
                raise BenchFailure(f"sizes must be >= {MIN_SIZE} with iterations >= 1: {step}")
        lanes = max(1, len(socks))
        reports = Reports(conn, lanes)
        for index, step in enumerate(spec.steps):
            begin = Start(lanes, barrier)
            runs = [_Run(spec, step, reports, progress, begin, index, j) for j in range(lanes)]
            run = runs[0]
            cls = load_target(step.target)
            methods = [cls(dataclasses.replace(spec.ctx, lane=j)) for j in range(lanes)]
            try:
                _dispatch(role, methods, runs, socks)
            except BaseException:
                for m in methods:
                    with contextlib.suppress(Exception):
                        _teardown(role, m)
                raise
    except BaseException as exc:  # report everything, Ctrl-C included, to the parent
        message = f"{type(exc).__name__}: {exc}"
        method, size = (run.step.method, run.size) if run else (None, None)
        with contextlib.suppress(OSError, ValueError):  # the parent may be gone already
            conn.send(ChildError(role, method, size, message, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        conn.close()
        for sock in socks:
            sock.close()
