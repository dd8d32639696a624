"""Results of a benchmark run: summaries, ratios, the machine and the JSON document.

Pure functions over plain data: nothing here imports torch or starts processes, so
the unit tests can check every number exactly. The text table is ``_table``.

Conventions:

- times are integer nanoseconds from ``time.perf_counter_ns()`` (CLOCK_MONOTONIC);
- the median of an even count is the mean of the two middle samples;
- p99 is nearest-rank: the ``ceil(0.99 * n)``-th smallest sample, always a real sample;
- GB/s is decimal (1e9 bytes per second): ``size / median``;
- "x floor" is this method's median over the ``floor`` median at the same size;
- a comparison (``COMPARISONS``) is one method's median over another's at the same
  size: relayd-mooncake over raw Mooncake moving the same bytes in the same run,
  and over ``floor-relay``, its own path with nothing on it but the bytes,
  the async client over the same hand-off driven from an event loop;
- the daemon CPU of a method whose reader has its own daemon (relayd-mooncake) is
  the sum of both daemons in the table ("d") and in ``cpu_ns_per_transfer.daemon``,
  and each side apart in ``daemon_cpu_ns_per_transfer``.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import importlib.metadata
import os
import platform
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relayd_bench._api import Parts

SCHEMA = "relayd-bench/1"
REFERENCE_METHOD = "floor"
# (method, baseline it is held against) beyond floor: the same bytes, the same engine
# or the same driving (an event loop on both sides)
COMPARISONS: tuple[tuple[str, str], ...] = (
    ("relayd-mooncake", "mooncake-raw"),
    ("relayd-mooncake", "floor-relay"),
    ("relayd-mooncake-view", "mooncake-raw"),
    ("relayd-mooncake-sync", "mooncake-raw"),
    ("relayd-mooncake-late", "mooncake-raw-late"),
    ("relayd-shm", "floor-async"),
)


class Status(enum.StrEnum):
    OK = "ok"
    SKIPPED = "skipped"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class Summary:
    n: int
    median_ns: float
    p99_ns: int
    min_ns: int
    max_ns: int
    mean_ns: float


@dataclasses.dataclass(frozen=True)
class Cpu:
    """CPU time (user + system) and minor page faults per transfer, by process role.

    ``None`` where a role was not measured (no daemon, or an in-process method).
    ``daemon_ns`` is the writer's daemon (the only one, for most methods);
    ``reader_daemon_ns`` the reader's, where it has its own (relayd-mooncake).
    ``*_wakeups``: the times that daemon's event loop was woken, per transfer.
    """

    writer_ns: float | None = None
    reader_ns: float | None = None
    daemon_ns: float | None = None
    writer_minflt: float | None = None
    reader_minflt: float | None = None
    reader_daemon_ns: float | None = None
    daemon_wakeups: float | None = None
    reader_daemon_wakeups: float | None = None

    @property
    def daemons_ns(self) -> float | None:
        """Every daemon involved: the writer's, plus the reader's if it has its own."""
        return _measured_sum(self.daemon_ns, self.reader_daemon_ns)

    @property
    def daemons_wakeups(self) -> float | None:
        """Wake-ups of every daemon involved, as :attr:`daemons_ns` adds their CPU."""
        return _measured_sum(self.daemon_wakeups, self.reader_daemon_wakeups)


def _measured_sum(writer_side: float | None, reader_side: float | None) -> float | None:
    """The sum of the sides measured; None if neither was."""
    parts = [v for v in (writer_side, reader_side) if v is not None]
    return sum(parts) if parts else None


@dataclasses.dataclass(frozen=True)
class Split:
    """Where a cell's transfers went: the median of each of their three parts, in ns.

    The parts (:data:`~relayd_bench._api.Parts`): the writer's send hook, the notify's
    trip to the reader, the reader's recv hook. Each median is its own, so the three
    need not add up to the cell's median exactly; set beside the floor's, they say
    which side of a hand-off a method's extra time is on.
    """

    send_ns: float
    trip_ns: float
    recv_ns: float


def split_of(parts: Sequence[Parts]) -> Split | None:
    """The :class:`Split` of these transfers' parts; None for none (a local method)."""
    if not parts:
        return None
    return Split(*(median([p[k] for p in parts]) for k in range(3)))


@dataclasses.dataclass
class Result:
    """One (method, size) cell of the stop-and-wait benchmark."""

    method: str
    size: int
    status: Status
    reason: str = ""
    warmup: int = 0
    iterations: int = 0
    latency: Summary | None = None
    cycle_median_ns: float | None = None
    cpu: Cpu = dataclasses.field(default_factory=Cpu)
    extra: dict[str, str] = dataclasses.field(default_factory=dict)
    ratio_vs_floor: float | None = None
    split: Split | None = None

    @property
    def gbps(self) -> float | None:
        if self.latency is None:
            return None
        return throughput_gbps(self.size, self.latency.median_ns)


@dataclasses.dataclass
class StreamResult:
    """N concurrent paced streams of one method; latency counts from the scheduled send time."""

    method: str
    streams: int
    chunk_size: int
    rate_hz: float
    status: Status
    reason: str = ""
    chunks: int = 0
    latency: Summary | None = None
    aggregate_chunks_per_s: float | None = None
    cpu: Cpu = dataclasses.field(default_factory=Cpu)
    extra: dict[str, str] = dataclasses.field(default_factory=dict)
    ratio_vs_floor: float | None = None
    pairs: int = 1  # writer/reader process pairs that carried the streams
    worst_by_second_ns: tuple[int, ...] = ()  # see worst_by_second

    @property
    def target_chunks_per_s(self) -> float:
        return self.streams * self.rate_hz

    @property
    def aggregate_gbps(self) -> float | None:
        if self.aggregate_chunks_per_s is None:
            return None
        return self.aggregate_chunks_per_s * self.chunk_size / 1e9


def median(samples: Sequence[int] | Sequence[float]) -> float:
    if not samples:
        raise ValueError("median of no samples")
    s = sorted(samples)
    mid = len(s) // 2
    if len(s) % 2:
        return float(s[mid])
    return (s[mid - 1] + s[mid]) / 2


def percentile_nearest_rank(samples: Sequence[int], q: int) -> int:
    """The ``ceil(q/100 * n)``-th smallest sample (1-based); integer maths, no interpolation."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0 < q <= 100:
        raise ValueError("q must be in (0, 100]")
    s = sorted(samples)
    rank = -(-q * len(s) // 100)  # ceil without floats, so p99 of 100 samples is the 99th
    return s[max(rank, 1) - 1]


def p99(samples: Sequence[int]) -> int:
    return percentile_nearest_rank(samples, 99)


def summarize(samples: Sequence[int]) -> Summary:
    return Summary(
        n=len(samples),
        median_ns=median(samples),
        p99_ns=p99(samples),
        min_ns=min(samples),
        max_ns=max(samples),
        mean_ns=sum(samples) / len(samples),
    )


def throughput_gbps(size: int, median_ns: float) -> float:
    # bytes per nanosecond is exactly decimal GB/s
    return size / median_ns if median_ns > 0 else float("inf")


def add_ratios(results: Iterable[Result], reference: str = REFERENCE_METHOD) -> None:
    """Fill ``ratio_vs_floor`` from the reference method's median at the same size."""
    results = list(results)
    base = {
        r.size: r.latency.median_ns
        for r in results
        if r.method == reference and r.latency is not None and r.latency.median_ns > 0
    }
    for r in results:
        if r.latency is not None and r.size in base:
            r.ratio_vs_floor = r.latency.median_ns / base[r.size]


def medians(results: Iterable[Result]) -> dict[tuple[str, int], float]:
    """Each measured cell's median, by (method, size)."""
    return {
        (r.method, r.size): r.latency.median_ns
        for r in results
        if r.latency is not None and r.latency.median_ns > 0
    }


def comparisons(results: Iterable[Result]) -> list[tuple[str, str, list[tuple[int, float]]]]:
    """For each of ``COMPARISONS`` that ran: (method, baseline, [(size, ratio of medians)])."""
    by_cell = medians(results)
    out = []
    for method, baseline in COMPARISONS:
        sizes = sorted(s for m, s in by_cell if m == method and (baseline, s) in by_cell)
        if sizes:
            out.append(
                (method, baseline, [(s, by_cell[method, s] / by_cell[baseline, s]) for s in sizes])
            )
    return out


def worst_by_second(streams: Iterable[Sequence[int]], rate_hz: float) -> tuple[int, ...]:
    """The worst latency of the chunks due in each second of the measured window.

    ``streams``: each stream's measured samples in order; its i-th is due i / rate
    after its first. One stall shows as one high second, queueing as many.
    """
    per = max(1, round(rate_hz))
    worst: list[int] = []
    for samples in streams:
        for i, ns in enumerate(samples):
            k = i // per
            worst.extend([0] * (k + 1 - len(worst)))
            worst[k] = max(worst[k], ns)
    return tuple(worst)


def add_stream_ratios(results: Iterable[StreamResult], reference: str = REFERENCE_METHOD) -> None:
    results = list(results)
    base = {
        (r.streams, r.chunk_size, r.rate_hz): r.latency.median_ns
        for r in results
        if r.method == reference and r.latency is not None and r.latency.median_ns > 0
    }
    for r in results:
        key = (r.streams, r.chunk_size, r.rate_hz)
        if r.latency is not None and key in base:
            r.ratio_vs_floor = r.latency.median_ns / base[key]


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read_sys(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def cpuidle_info(sys_root: str = "/sys") -> dict[str, Any] | None:
    """How this machine's idle cores sleep: the cpuidle driver and governor and,
    under ``haltpoll`` (a VM guest), how long an idle core polls before it halts.
    A halted virtual core is woken through the host, which the wake probe times;
    None where the kernel says nothing."""
    base = f"{sys_root}/devices/system/cpu/cpuidle"
    driver = _read_sys(f"{base}/current_driver")
    if driver is None:
        return None
    governor = _read_sys(f"{base}/current_governor_ro") or _read_sys(f"{base}/current_governor")
    poll = _read_sys(f"{sys_root}/module/haltpoll/parameters/guest_halt_poll_ns")
    return {
        "driver": driver,
        "governor": governor,
        "guest_halt_poll_ns": int(poll) if poll is not None and poll.isdigit() else None,
    }


# Congestion controls that pace every connection's sends by timers (bbr sets
# SK_PACING_NEEDED whatever the qdisc): on loopback too, where nothing else would
# slow a send down.
PACING_CONGESTION_CONTROLS = frozenset({"bbr"})


def tcp_info(proc_root: str = "/proc") -> dict[str, Any] | None:
    """This network namespace's TCP congestion control, which namespaces created
    later (``--netns``) start with, and whether it paces. The cross-node methods
    move their bytes over TCP (Mooncake's transport and relayd's peer channel),
    and on loopback the pacing changes mooncake-raw's speed from 1 MiB up far
    more than relayd's (the README's benchmark section has an A/B); None where
    the kernel says nothing."""
    cc = _read_sys(f"{proc_root}/sys/net/ipv4/tcp_congestion_control")
    if not cc:
        return None
    return {"congestion_control": cc, "paced": cc in PACING_CONGESTION_CONTROLS}


def machine_info() -> dict[str, Any]:
    """Describe the machine without importing torch (it costs seconds in the parent)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 0
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "kernel": platform.release(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": _dist_version("torch"),
        "numpy": _dist_version("numpy"),
        "grpcio": _dist_version("grpcio"),
        "loadavg": load,  # 1/5/15 min when the run ended: other work skews every number
        "cpuidle": cpuidle_info(),
        "tcp": tcp_info(),
    }


def _summary_json(s: Summary | None) -> dict[str, Any] | None:
    return None if s is None else dataclasses.asdict(s)


def result_json(r: Result) -> dict[str, Any]:
    return {
        "method": r.method,
        "size": r.size,
        "status": r.status.value,
        "reason": r.reason,
        "warmup": r.warmup,
        "iterations": r.iterations,
        "latency_ns": _summary_json(r.latency),
        "median_ns": r.latency.median_ns if r.latency else None,
        "p99_ns": r.latency.p99_ns if r.latency else None,
        "gbps": r.gbps,
        "ratio_vs_floor": r.ratio_vs_floor,
        "cycle_median_ns": r.cycle_median_ns,
        "split_ns": None if r.split is None else dataclasses.asdict(r.split),
        "cpu_ns_per_transfer": _cpu_sides(r.cpu),
        "daemon_cpu_ns_per_transfer": _daemon_sides(r.cpu),
        "daemon_wakeups_per_transfer": _wakeup_sides(r.cpu),
        "minflt_per_transfer": {"writer": r.cpu.writer_minflt, "reader": r.cpu.reader_minflt},
        "extra": dict(r.extra),
    }


def _cpu_sides(cpu: Cpu) -> dict[str, float | None]:
    return {"writer": cpu.writer_ns, "reader": cpu.reader_ns, "daemon": cpu.daemons_ns}


def _daemon_sides(cpu: Cpu) -> dict[str, float | None]:
    return {"writer_side": cpu.daemon_ns, "reader_side": cpu.reader_daemon_ns}


def _wakeup_sides(cpu: Cpu) -> dict[str, float | None]:
    return {"writer_side": cpu.daemon_wakeups, "reader_side": cpu.reader_daemon_wakeups}


def stream_json(r: StreamResult) -> dict[str, Any]:
    return {
        "method": r.method,
        "status": r.status.value,
        "reason": r.reason,
        "streams": r.streams,
        "process_pairs": r.pairs,
        "worst_latency_ns_by_second": list(r.worst_by_second_ns),
        "chunk_size": r.chunk_size,
        "rate_hz": r.rate_hz,
        "chunks": r.chunks,
        "latency_ns": _summary_json(r.latency),
        "aggregate_chunks_per_s": r.aggregate_chunks_per_s,
        "target_chunks_per_s": r.target_chunks_per_s,
        "aggregate_gbps": r.aggregate_gbps,
        "ratio_vs_floor": r.ratio_vs_floor,
        "cpu_ns_per_chunk": _cpu_sides(r.cpu),
        "daemon_cpu_ns_per_chunk": _daemon_sides(r.cpu),
        "daemon_wakeups_per_chunk": _wakeup_sides(r.cpu),
        "extra": dict(r.extra),
    }


def to_json(
    results: Sequence[Result],
    streams: Sequence[StreamResult] = (),
    machine: dict[str, Any] | None = None,
    run: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine if machine is not None else machine_info(),
        "run": run or {},
        "results": [result_json(r) for r in results],
        "comparisons": [
            {
                "method": method,
                "baseline": baseline,
                "ratio_of_medians": [{"size": size, "ratio": ratio} for size, ratio in ratios],
            }
            for method, baseline, ratios in comparisons(results)
        ],
        "streams": [stream_json(s) for s in streams],
    }
