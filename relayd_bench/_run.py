"""One benchmark run: the jobs in order, the daemon when a method needs it, and the cleanup.

Order: the baselines first (no daemon running yet, so nothing else competes for
the two cores), then the daemon is started and the relayd methods run, then the
stream workload. When relayd-mooncake will run and the bench starts the daemon
itself (no ``--socket``), it starts two: the writer's, and a Mooncake peer for the
reader to attach to (``_daemon.start_pair``); the other relayd methods use the
first. A full run gives each (method, size) a fresh process pair, as
the reference measurements did. With ``reuse_processes`` (implied by ``--quick``)
one pair runs every method of a kind (baselines or relayd) and size in turn, and
one set of stream pairs runs every stream method: spawning a process that imports
torch (and grpc) costs 2-4 s of CPU here, which alone would blow the quick budget.
A job that fails stops there; what it did not reach runs again in fresh processes.

With ``netns`` the bench first creates two network namespaces joined by a veth
pair (rate-limited with tbf when ``netns_rate`` is set), starts the two daemons one
in each, and runs the writer and reader of each cross-node method (``Entry.cross_node``)
one in each, their notify channel a TCP connection across the same link. The
namespaces go when the bench closes, after the daemons have stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

from relayd_bench import _coldcall, _daemon, _daemon_profile, _handoff, _netns, _timeline, _wake
from relayd_bench._api import BenchContext, JobSpec, Pace, SizePlan, Step, WriterReport
from relayd_bench._harness import JobOutcome, run_jobs
from relayd_bench._progress import Progress
from relayd_bench._registry import ENTRIES, NAME_WIDTH, STREAM, Entry
from relayd_bench._rounds import median_cells
from relayd_bench._stats import (
    Cpu,
    Result,
    Status,
    StreamResult,
    median,
    split_of,
    summarize,
    worst_by_second,
)
from relayd_bench._table import fmt_ns, fmt_size

# perf-baselines.md, "Iterations per payload size": (size, warm-up, measured)
REFERENCE_PLAN = (
    (4 << 10, 300, 3000),
    (256 << 10, 100, 1500),
    (1 << 20, 50, 800),
    (4 << 20, 30, 400),
    (16 << 20, 20, 250),
)
MIN_WARMUP = 2
MIN_ITERATIONS = 20  # below this a p99 is just the maximum
STREAM_CHUNK = 1 << 20


def plan_for(size: int, scale: float) -> SizePlan:
    """The reference counts of the largest reference size not above ``size``, scaled."""
    warmup, iterations = REFERENCE_PLAN[0][1:]
    for ref_size, w, n in REFERENCE_PLAN:
        if size >= ref_size:
            warmup, iterations = w, n
    return SizePlan(
        size, max(MIN_WARMUP, round(warmup * scale)), max(MIN_ITERATIONS, round(iterations * scale))
    )


@dataclasses.dataclass(frozen=True)
class Options:
    sizes: tuple[int, ...]
    methods: tuple[str, ...]
    scale: float = 1.0
    reuse_processes: bool = False
    socket: str | None = None
    reader_socket: str | None = None
    shm_pool_size: str = "512MiB"
    daemon_timeout_s: float = 30.0
    job_timeout_s: float = 600.0
    streams: int = 4
    stream_pairs: int = 1
    stream_rate: float = 50.0
    stream_chunk: int = STREAM_CHUNK
    stream_seconds: float = 5.0
    stream_warmup_s: float = 0.5
    stream_methods: tuple[str, ...] = ("floor", "relayd-shm")
    netns: bool = False
    netns_rate: str | None = None
    rounds: int = 1
    timeline: bool = False  # probes in the cross-node methods' four processes (_timeline)
    profile_dir: str | None = None  # the daemons the bench starts, under cProfile (_daemon_profile)


class Bench:
    def __init__(self, opts: Options, progress: Progress) -> None:
        self.opts = opts
        self.progress = progress
        self.run_id = secrets.token_hex(4)
        self.shm_prefix = f"relayd-bench-{self.run_id}-"
        self.tmpdir = Path(tempfile.mkdtemp(prefix="relayd-bench-"))
        self.daemon: _daemon.Daemon | None = None
        self.daemon_error: str | None = None
        self.reader_daemon: _daemon.Daemon | None = None  # relayd-mooncake's reader's node
        self.reader_daemon_error: str | None = None
        self.leftover_segments: list[str] = []
        self.warnings: list[str] = []
        self.results: list[Result] = []
        self.rounds: list[list[Result]] = []  # each round's cells; results: the median ones
        self.streams: list[StreamResult] = []
        self.started = time.monotonic()
        self.loadavg_at_start = [round(x, 2) for x in os.getloadavg()]
        self.cold_call: _coldcall.ColdCall | None = None
        self.wake: _wake.Wake | None = None
        self.handoff: _handoff.Handoff | None = None
        self.netns: _netns.Netns | None = None
        self._namespaces = contextlib.ExitStack()
        self.link_bytes: tuple[int, int] | None = None  # what each veth end sent, at close
        self.timeline_dir = self.tmpdir / "timeline"
        self.timeline = ""  # --timeline: the tables, once the methods ran
        self.profiles: list[Path] = []  # --profile: the daemons' reports, once they stopped

    def run(self) -> None:
        """Raises ``_netns.NetnsUnavailable`` if ``netns`` is asked for and cannot be set up."""
        self.cold_call = _coldcall.probe()
        self.wake = _wake.probe()
        self.handoff = _handoff.probe()
        if self.opts.timeline:
            # Before any method: a baseline may run before the daemons start.
            self.timeline_dir.mkdir(exist_ok=True)
        if self.opts.netns:
            rate = self.opts.netns_rate
            self.progress.line(f"creating two network namespaces, veth at {rate or 'full speed'}")
            self.netns = self._namespaces.enter_context(_netns.netns_pair(rate=rate))
        entries = [ENTRIES[n] for n in self.opts.methods if n != STREAM]
        for k in range(self.opts.rounds):
            if self.opts.rounds > 1:
                self.progress.line(f"round {k + 1} of {self.opts.rounds}")
            # every other round backwards, so that no method always runs first
            self.rounds.append(self._run_methods(entries if k % 2 == 0 else entries[::-1]))
        self.results = median_cells(self.rounds)
        if self.opts.timeline:
            self.timeline = _timeline.report(self.timeline_dir)
        if STREAM in self.opts.methods:
            self._run_streams([ENTRIES[n] for n in self.opts.stream_methods])

    def close(self) -> None:
        try:
            daemons = {"the daemon": self.daemon, "the reader's daemon": self.reader_daemon}
            named = [(name, d) for name, d in daemons.items() if d is not None]
            for _, d in named:
                d.record_transfers()  # for the JSON: what moved over which transport
            _daemon.stop_all([d for _, d in named])
            if self.opts.profile_dir:
                moved = {d.socket: sum((d.transfers or {}).values()) for _, d in named if d.started}
                self.profiles = _daemon_profile.write_reports(Path(self.opts.profile_dir), moved)
            for name, d in named:
                if d.leftover_segments:
                    n = len(d.leftover_segments)
                    self._warn(f"{name} left {n} segment(s) in /dev/shm after SIGTERM")
                if d.exit_code not in (0, None):
                    self._warn(f"{name} exited with code {d.exit_code} on SIGTERM")
        finally:
            try:
                if self.netns is not None:
                    with contextlib.suppress(Exception):  # best effort: for the record
                        self.link_bytes = (self.netns.tx_bytes(0), self.netns.tx_bytes(1))
                self._namespaces.close()  # after the daemons inside them have stopped
            finally:
                self._sweep()
                shutil.rmtree(self.tmpdir, ignore_errors=True)

    def describe(self) -> dict[str, object]:
        return {
            "run_id": self.run_id,
            "shm_prefix": self.shm_prefix,
            "duration_s": round(time.monotonic() - self.started, 1),
            "loadavg_at_start": self.loadavg_at_start,
            "leftover_segments": list(self.leftover_segments),
            "warnings": list(self.warnings),
            "daemon": self.daemon.describe() if self.daemon else None,
            "daemon_error": self.daemon_error,
            "reader_daemon": self.reader_daemon.describe() if self.reader_daemon else None,
            "reader_daemon_error": self.reader_daemon_error,
            "netns": None
            if self.netns is None
            else {
                "names": list(self.netns.names),
                "addrs": list(self.netns.addrs),
                "rate": self.opts.netns_rate,
                "link_tx_bytes": list(self.link_bytes) if self.link_bytes else None,
            },
        }

    def network_line(self) -> str | None:
        """Where the cross-node methods ran, for under the table; None on loopback."""
        if self.netns is None:
            return None
        moved = ""
        if self.link_bytes is not None:
            a, b = (f"{n / 1e6:.1f} MB" for n in self.link_bytes)
            moved = f"; it carried {a} writer->reader, {b} back"
        rate = self.opts.netns_rate or "unshaped"
        return f"cross-node methods: two network namespaces, veth link {rate}{moved}"

    def _ctx(
        self, stream_index: int = 0, cross_node: bool = False, stream: bool = False
    ) -> BenchContext:
        d, r, ns = self.daemon, self.reader_daemon, self.netns
        ctx = BenchContext(
            run_id=self.run_id,
            shm_prefix=self.shm_prefix,
            socket=d.socket if d else self.opts.socket,
            reader_socket=r.socket if r else self.opts.reader_socket,
            daemon_pid=d.pid if d else None,
            reader_daemon_pid=r.pid if r else None,
            stream_index=stream_index,
        )
        if ns and cross_node:
            ctx = dataclasses.replace(ctx, netns=ns.names, hosts=ns.addrs)
        if self.opts.timeline and cross_node and not stream:  # stop-and-wait runs only
            ctx = dataclasses.replace(ctx, timeline=str(self.timeline_dir))
        return ctx

    def _unavailable(self, entry: Entry) -> str | None:
        return entry.unavailable(socket=self.opts.socket, reader_socket=self.opts.reader_socket)

    def _warn(self, text: str) -> None:
        self.warnings.append(text)
        self.progress.line(f"warning: {text}")

    def _sweep(self) -> None:
        """Remove this run's segments a method failed to clean up, and remember them."""
        try:
            names = [n for n in os.listdir("/dev/shm") if n.startswith(self.shm_prefix)]
        except OSError:
            return
        for name in names:
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                continue
            self.leftover_segments.append(name)
        if names:
            self._warn(f"removed {len(names)} leftover segment(s) of this run: {names[0]} …")

    def _ensure_daemon(self) -> str | None:
        """Start (or attach to) the daemon, and the reader's daemon if a method needs one."""
        if self.daemon is not None or self.daemon_error is not None:
            return self.daemon_error
        o = self.opts
        try:
            if o.socket:
                self.daemon = _daemon.attach(o.socket, o.daemon_timeout_s)
            elif self._needs_peer_daemon():
                self._start_pair()
            else:
                self.progress.line("starting relayd serve for the relayd methods")
                self.daemon = _daemon.start(
                    self.tmpdir,
                    o.shm_pool_size,
                    o.daemon_timeout_s,
                    prefix=self._prefix(probes=False),
                )
        except _daemon.DaemonError as exc:
            self.daemon_error = f"daemon unavailable: {exc}"
        if o.reader_socket and self.reader_daemon is None and self.reader_daemon_error is None:
            try:  # the user's: check it answers, and find its pid for CPU accounting
                self.reader_daemon = _daemon.attach(o.reader_socket, o.daemon_timeout_s)
            except _daemon.DaemonError as exc:
                self.reader_daemon_error = f"reader's daemon unavailable: {exc}"
        return self.daemon_error

    def _needs_peer_daemon(self) -> bool:
        """Whether a method that will run needs a second daemon that the bench must start."""
        names = [n for n in self.opts.methods if n != STREAM]
        if STREAM in self.opts.methods:
            names += self.opts.stream_methods
        return not self.opts.reader_socket and any(
            ENTRIES[n].needs_peer_daemon and self._unavailable(ENTRIES[n]) is None for n in names
        )

    def _start_pair(self) -> None:
        """Two peered daemons; if the pair fails, the single daemon the other methods need."""
        o = self.opts
        where = "one in each network namespace" if self.netns else "on loopback"
        self.progress.line(f"starting two relayd serve, Mooncake peers {where}")
        try:
            self.daemon, self.reader_daemon = _daemon.start_pair(
                self.tmpdir,
                o.shm_pool_size,
                o.daemon_timeout_s,
                f"bench-{self.run_id}",
                self.netns,
                self._prefix(),
            )
        except _daemon.DaemonError as exc:
            self.reader_daemon_error = f"peer daemons unavailable: {exc}"
            self._warn(self.reader_daemon_error)
            self.daemon = _daemon.start(
                self.tmpdir, o.shm_pool_size, o.daemon_timeout_s, prefix=self._prefix(probes=False)
            )

    def _prefix(self, *, probes: bool = True) -> list[str]:
        """What the daemons the bench starts run through: the timeline's probes
        (``probes``: a pair's, for the cross-node methods they follow) or the
        profiler (the options allow one of the two), else nothing."""
        if self.opts.timeline and probes:
            return _timeline.daemon_prefix(self.timeline_dir)
        if self.opts.profile_dir:
            return _daemon_profile.prefix(Path(self.opts.profile_dir))
        return []

    def _run_methods(self, entries: list[Entry]) -> list[Result]:
        """Each (method, size) in fresh processes, or with reuse one job per kind of process."""
        results: dict[tuple[str, int], Result] = {}
        jobs: list[tuple[bool, list[Step]]] = []
        by_kind: dict[tuple[bool, bool, bool], list[Step]] = {}
        for entry in entries:
            plans = self._plans(entry, results)
            if not plans:
                continue
            step = Step(entry.name, entry.target, tuple(plans), entry.needs_peer_daemon)
            if self.opts.reuse_processes:
                # baselines before the daemon starts; pairs and single processes apart
                # and with namespaces, cross-node methods apart: their pair runs in them
                apart = entry.cross_node and self.netns is not None
                by_kind.setdefault((entry.needs_daemon, entry.local, apart), []).append(step)
            else:
                jobs += [(entry.local, [dataclasses.replace(step, sizes=(p,))]) for p in plans]
        jobs += [(local, steps) for (_, local, _), steps in by_kind.items()]
        jobs.sort(key=lambda job: ENTRIES[job[1][0].method].needs_daemon)  # stable
        while jobs:
            local, steps = jobs.pop(0)
            if ENTRIES[steps[0].method].needs_daemon:
                steps = self._runnable(steps, results)
                if not steps:
                    continue
            [outcome] = run_jobs(
                [JobSpec(tuple(steps), self._ctx(cross_node=ENTRIES[steps[0].method].cross_node))],
                local=local,
                timeout_s=self.opts.job_timeout_s,
                progress=self.progress,
                describe=_describe,
            )
            self._sweep()
            rest = self._collect(steps, outcome, results)
            if rest:
                jobs.insert(0, (local, rest))  # what the failure cut short, in fresh processes
        return [results[entry.name, s] for entry in entries for s in self.opts.sizes]

    def _runnable(self, steps: list[Step], results: dict[tuple[str, int], Result]) -> list[Step]:
        """The steps whose daemons are up; the others are recorded as failed, with why."""
        daemon_error = self._ensure_daemon()
        keep = []
        for step in steps:
            why = daemon_error or (self.reader_daemon_error if step.reader_daemon else None)
            if why is None:
                keep.append(step)
                continue
            for p in step.sizes:
                results[step.method, p.size] = Result(step.method, p.size, Status.FAILED, why)
        return keep

    def _plans(self, entry: Entry, results: dict[tuple[str, int], Result]) -> list[SizePlan]:
        """The sizes to run; records skipped ones (and a method that cannot run here) in results."""
        why = self._unavailable(entry)
        plans = []
        for size in self.opts.sizes:
            skip = why or entry.skip_size(size)
            if skip:
                results[entry.name, size] = Result(entry.name, size, Status.SKIPPED, skip)
            else:
                plans.append(plan_for(size, self.opts.scale))
        return plans

    def _collect(
        self, steps: list[Step], outcome: JobOutcome, results: dict[tuple[str, int], Result]
    ) -> list[Step]:
        """Record what the job measured; return the steps it did not reach."""
        pending = [(step, p) for step in steps for p in step.sizes]
        done = [(step, p) for step, p in pending if outcome.complete(step.method, p.size)]
        for step, p in done:
            r = _result(ENTRIES[step.method], p, outcome)
            results[step.method, p.size] = r
            self._report(r)
        todo = [(step, p) for step, p in pending if not outcome.complete(step.method, p.size)]
        if not todo:
            if outcome.error is not None:
                # every size reported, then something broke (teardown, the end handshake)
                self._warn(f"{outcome.error.role}: {outcome.error.message}")
            return []
        # steps and sizes run in order, so the first unfinished one is where it broke
        step, p = todo[0]
        err = outcome.error
        reason = err.message if err else "no report from the benchmark processes"
        results[step.method, p.size] = Result(step.method, p.size, Status.FAILED, reason)
        self._report(results[step.method, p.size])
        rest: list[Step] = []
        for step, p in todo[1:]:
            if rest and rest[-1].method == step.method:
                rest[-1] = dataclasses.replace(rest[-1], sizes=(*rest[-1].sizes, p))
            else:
                rest.append(dataclasses.replace(step, sizes=(p,)))
        return rest

    def _report(self, r: Result) -> None:
        head = f"{r.method:<{NAME_WIDTH}}{fmt_size(r.size):>8}  "
        if r.latency is None:
            self.progress.line(f"{head}{r.status.value}: {r.reason}")
        else:
            lat = r.latency
            self.progress.line(f"{head}median {fmt_ns(lat.median_ns)}  p99 {fmt_ns(lat.p99_ns)}")

    def _run_streams(self, entries: list[Entry]) -> None:
        o = self.opts
        plan = SizePlan(
            o.stream_chunk,
            max(1, round(o.stream_rate * o.stream_warmup_s)),
            max(1, round(o.stream_rate * o.stream_seconds)),
        )
        results: dict[str, StreamResult] = {}
        runnable: list[Entry] = []
        for entry in entries:
            base = StreamResult(
                entry.name,
                o.streams,
                o.stream_chunk,
                o.stream_rate,
                Status.OK,
                pairs=len(self._stream_lanes(entry)),
            )
            why = self._unavailable(entry) or (
                "the stream workload needs a writer/reader pair" if entry.local else None
            )
            if why:
                results[entry.name] = dataclasses.replace(base, status=Status.SKIPPED, reason=why)
            elif entry.needs_daemon and (
                why := self._ensure_daemon()
                or (self.reader_daemon_error if entry.needs_peer_daemon else None)
            ):
                results[entry.name] = dataclasses.replace(base, status=Status.FAILED, reason=why)
            else:
                results[entry.name] = base
                runnable.append(entry)
        if o.reuse_processes and self.netns is None:  # else cross-node ones apart
            groups = [[e for e in runnable if e.shares_process == s] for s in (True, False)]
        else:
            groups = [[e] for e in runnable]
        for group in groups:
            if group:
                self._stream_job(group, plan, results)
        self.streams += [results[e.name] for e in entries]

    def _stream_lanes(self, entry: Entry) -> list[int]:
        o = self.opts
        return stream_lanes(o.streams, o.stream_pairs if entry.shares_process else o.streams)

    def _stream_job(
        self, group: list[Entry], plan: SizePlan, results: dict[str, StreamResult]
    ) -> None:
        o = self.opts
        period = round(1e9 / o.stream_rate)
        steps = tuple(Step(e.name, e.target, (plan,), e.needs_peer_daemon) for e in group)
        specs, first = [], 0
        for k, lanes in enumerate(self._stream_lanes(group[0])):
            # stream s (lane j of pair k) is due s / streams of a period after the start
            pace = Pace(period, first * period // o.streams, period // o.streams)
            ctx = self._ctx(stream_index=k, cross_node=group[0].cross_node, stream=True)
            specs.append(JobSpec(steps, ctx, pace, measure_daemon=(k == 0), lanes=lanes))
            first += lanes
        outcomes = run_jobs(
            specs,
            local=False,
            timeout_s=o.job_timeout_s + o.stream_seconds * len(group),
            progress=self.progress,
            describe=lambda s, i, _, d, t: (
                f"stream {s.steps[i].method} x{o.streams}: {d}/{t} chunks"
            ),
        )
        self._sweep()
        for entry in group:
            r = _stream_result(results[entry.name], plan, outcomes)
            results[entry.name] = r
            if r.latency is not None:
                lat, rate = r.latency, r.aggregate_chunks_per_s or 0
                self.progress.line(
                    f"stream {entry.name} x{o.streams}: p50 {fmt_ns(lat.median_ns)}"
                    f"  p99 {fmt_ns(lat.p99_ns)}  {rate:.0f} chunks/s"
                )
            else:
                self.progress.line(f"stream {entry.name}: {r.status.value}: {r.reason}")


def stream_lanes(streams: int, pairs: int) -> list[int]:
    """How many streams each writer/reader process pair carries: as even as can be."""
    pairs = max(1, min(pairs, streams))
    return [streams // pairs + (k < streams % pairs) for k in range(pairs)]


def _describe(spec: JobSpec, step: int, index: int, done: int, total: int) -> str:
    s = spec.steps[min(step, len(spec.steps) - 1)]
    plan = s.sizes[min(index, len(s.sizes) - 1)]
    phase = "warm-up" if done < plan.warmup else "measuring"
    return f"{s.method} {fmt_size(plan.size)}: {phase} {done}/{total}"


def _per(value: float | None, n: int) -> float | None:
    return None if value is None or n <= 0 else value / n


def _daemons(w: WriterReport, n: int) -> dict[str, float | None]:
    """The :class:`Cpu` fields of the daemons ``w`` sampled: CPU and wake-ups per transfer."""
    fields: dict[str, float | None] = {}
    for side, sample in (("daemon", w.daemon), ("reader_daemon", w.reader_daemon)):
        fields[f"{side}_ns"] = None if sample is None else _per(sample.cpu_ns, n)
        fields[f"{side}_wakeups"] = None if sample is None else _per(sample.wakeups, n)
    return fields


def _result(entry: Entry, plan: SizePlan, o: JobOutcome) -> Result:
    w, r = o.writer[entry.name, plan.size], o.reader[entry.name, plan.size]
    n = plan.iterations
    cpu = Cpu(
        writer_ns=_per(w.usage.cpu_ns, n),
        reader_ns=None if entry.local else _per(r.usage.cpu_ns, n),
        writer_minflt=_per(w.usage.minflt, n),
        reader_minflt=None if entry.local else _per(r.usage.minflt, n),
        **_daemons(w, n),
    )
    return Result(
        entry.name,
        plan.size,
        Status.OK,
        warmup=plan.warmup,
        iterations=n,
        latency=summarize(r.samples_ns),
        cycle_median_ns=None if entry.local else median(w.cycles_ns),
        cpu=cpu,
        extra={**r.extra, **w.extra},
        split=split_of(r.parts_ns),
    )


def _stream_result(base: StreamResult, plan: SizePlan, outcomes: list[JobOutcome]) -> StreamResult:
    key = (base.method, plan.size)
    for o in outcomes:
        if not o.complete(*key):
            msg = o.error.message if o.error else "no report from the benchmark processes"
            return dataclasses.replace(base, status=Status.FAILED, reason=msg)
    writers = [o.writer[key] for o in outcomes]
    readers = [o.reader[key] for o in outcomes]
    samples = [s for r in readers for s in r.samples_ns]
    chunks = len(samples)
    n = plan.iterations  # a report holds its process's streams one after another
    streams = [r.samples_ns[j : j + n] for r in readers for j in range(0, len(r.samples_ns), n)]
    window_ns = max(w.end_ns for w in writers) - min(w.start_ns for w in writers)
    return dataclasses.replace(
        base,
        chunks=chunks,
        latency=summarize(samples),
        aggregate_chunks_per_s=chunks / (window_ns / 1e9) if window_ns > 0 else None,
        worst_by_second_ns=worst_by_second(streams, base.rate_hz),
        cpu=Cpu(
            writer_ns=_per(sum(w.usage.cpu_ns for w in writers), chunks),
            reader_ns=_per(sum(r.usage.cpu_ns for r in readers), chunks),
            # stream 0 samples the daemon(s) over (about) everyone's window
            **_daemons(writers[0], chunks),
        ),
        extra=dict(writers[0].extra),
    )
