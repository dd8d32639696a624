"""The text table of a benchmark run: fixed-width, every line within ``TABLE_WIDTH``.

Formats the results of ``_stats`` (median, p99 and ratios per method and size, the
comparisons, the round-trip model of ``_rtt``, the stream workload); computes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from relayd_bench import _rtt
from relayd_bench._coldcall import ColdCall
from relayd_bench._handoff import Handoff
from relayd_bench._rounds import RoundRatios
from relayd_bench._stats import (
    COMPARISONS,
    Cpu,
    Result,
    Split,
    Status,
    StreamResult,
    comparisons,
)
from relayd_bench._wake import Wake

TABLE_WIDTH = 100


def fmt_ns(ns: float | None) -> str:
    """Three significant figures, like the reference tables: 0.9 µs, 44.3 µs, 307 µs, 1.23 ms."""
    if ns is None:
        return "-"
    if ns < 1e6:
        us = ns / 1e3
        return f"{us:.1f} µs" if us < 100 else f"{us:.0f} µs"
    v, unit = (ns / 1e6, "ms") if ns < 1e9 else (ns / 1e9, "s")
    digits = 2 if v < 10 else 1 if v < 100 else 0
    return f"{v:.{digits}f} {unit}"


def fmt_size(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f}{unit}"
    return f"{size}B"


def _fmt_ratio(r: float | None) -> str:
    if r is None:
        return "-"
    return f"x{r:.2f}" if r < 10 else f"x{r:.1f}" if r < 100 else f"x{r:.0f}"


def _fmt_gbps(gbps: float | None) -> str:
    return "-" if gbps is None else f"{gbps:.2f}"


def _fmt_us(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e3:.0f}" if ns >= 1e4 else f"{ns / 1e3:.1f}"


def _fmt_flt(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}" if v >= 10 or v < 0.05 else f"{v:.1f}"


def _clip(line: str, width: int) -> str:
    return line if len(line) <= width else line[: width - 1] + "…"


def _note(extra: dict[str, str]) -> str:
    """What the method observed; the transport is the common case, so it goes bare."""
    items = sorted(extra.items(), key=lambda kv: kv[0] != "transport")
    return " ".join(v if k == "transport" else f"{k}={v}" for k, v in items)


def _cpu_cell(cpu: Cpu) -> str:
    return f"{_fmt_us(cpu.writer_ns)}/{_fmt_us(cpu.reader_ns)}/{_fmt_us(cpu.daemons_ns)}"


def _wakeup_cell(cpu: Cpu) -> str:
    v = cpu.daemons_wakeups
    return "-" if v is None else f"{v:.2f}" if v < 10 else f"{v:.0f}"


def _flt_cell(cpu: Cpu) -> str:
    return f"{_fmt_flt(cpu.writer_minflt)}/{_fmt_flt(cpu.reader_minflt)}"


def render_table(
    results: Sequence[Result],
    streams: Sequence[StreamResult] = (),
    machine: dict[str, Any] | None = None,
    width: int = TABLE_WIDTH,
    rounds: Sequence[RoundRatios] = (),
) -> str:
    """Fixed-width text: a method x size overview, per-cell details, then the stream workload.

    Every line fits in ``width`` columns (long reasons are clipped with "…").
    """
    out: list[str] = []
    if machine:
        out += [_clip(line, width) for line in _machine_line(machine).split("\n")]
        out.append("")
    if results:
        out += _render_matrix(results, width)
        out += _render_comparisons(results, width)
        out.append("")
        out += _render_details(results, width)
        out += _render_splits(results, width)
        out += _render_round_trips(results)
    if rounds:
        out.append("")
        out += _render_rounds(rounds, width)
    if streams:
        if results:
            out.append("")
        out += _render_streams(streams, width)
    cpus = [r.cpu for r in results] + [s.cpu for s in streams]
    if any(c.daemons_wakeups is not None for c in cpus):
        out.append("d wk: times the daemon's event loop was woken, per transfer: beside CPU µs d,")
        out.append("whether the daemon works more often or more each time")
    if any(c.reader_daemon_ns is not None for c in cpus):
        out.append(
            "CPU µs d, d wk: the writer's daemon + the reader's, where the reader has its own"
        )
    return "\n".join(_clip(line.rstrip(), width) for line in out) + "\n"


def _machine_line(m: dict[str, Any]) -> str:
    # The load when the run started says what else was running; at the end it
    # also counts the run's own stream phase (2 x streams processes).
    start, end = m.get("loadavg_at_start") or [], m.get("loadavg") or []
    load = ""
    if start:
        load = f"\nload (1-min average) {start[0]:.1f} at start"
        load += f", {end[0]:.1f} at end" if end else ""
    elif len(end) >= 2:
        load = f" · load {end[0]:.1f}/{end[1]:.1f}"
    cold, wake, handoff = m.get("cold_call"), m.get("wake"), m.get("handoff")
    return (
        f"{m.get('cpu_model', '?')} · {m.get('cores', '?')} cores · Linux {m.get('kernel', '?')}"
        f" · Python {m.get('python', '?')} · torch {m.get('torch', '?')}"
        + load
        + ("" if not cold else "\n" + ColdCall(**cold).line())
        + ("" if not wake else "\n" + Wake(**wake).line())
        + ("" if not handoff else "\n" + Handoff(**handoff).line())
        + _idle_line(m.get("cpuidle"))
        + _tcp_line(m.get("tcp"))
    )


def _idle_line(idle: dict[str, Any] | None) -> str:
    """How idle cores sleep, as a line of its own (nothing where unknown)."""
    if not idle:
        return ""
    line = f"\nidle cores: cpuidle driver {idle['driver']}, governor {idle.get('governor') or '?'}"
    poll = idle.get("guest_halt_poll_ns")
    if poll is not None:
        line += f", polling {poll / 1e3:g} µs before a halt"
    return line


def _tcp_line(tcp: dict[str, Any] | None) -> str:
    """The TCP congestion control the cross-node methods' connections get."""
    if not tcp:
        return ""
    paced = ", which paces every connection, loopback's too" if tcp.get("paced") else ""
    return f"\ntcp: congestion control {tcp['congestion_control']}{paced}"


def _ordered(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))


def _render_matrix(results: Sequence[Result], width: int) -> list[str]:
    methods = _ordered(r.method for r in results)
    cells = {(r.method, r.size): _latency_cell(r) for r in results}
    name_w = min(max(len(m) for m in methods) + 2, 22)
    head = "one-way latency, stop-and-wait: median and ratio to floor at the same size"
    return [head, *_by_size(methods, cells, name_w, 16, width, str.ljust)]


def _latency_cell(r: Result) -> str:
    if r.status is not Status.OK or r.latency is None:
        return r.status.value
    return f"{fmt_ns(r.latency.median_ns)} {_fmt_ratio(r.ratio_vs_floor)}"


def _by_size(
    methods: Sequence[str],
    cells: dict[tuple[str, int], str],
    name_w: int,
    cell_w: int,
    width: int,
    align: Callable[[str, int], str],
) -> list[str]:
    """A method x size matrix of ``cells`` (blank where a method has none), in
    blocks of as many sizes as fit in ``width``."""
    sizes = sorted({size for _, size in cells})
    per_block = max(1, (width - name_w) // cell_w)
    out = []
    for start in range(0, len(sizes), per_block):
        block = sizes[start : start + per_block]
        out.append("method".ljust(name_w) + "".join(align(fmt_size(s), cell_w) for s in block))
        for m in methods:
            row = m[: name_w - 1].ljust(name_w)
            row += "".join(align(cells.get((m, s), "")[: cell_w - 1], cell_w) for s in block)
            out.append(row.rstrip())
    return out


def _render_comparisons(results: Sequence[Result], width: int) -> list[str]:
    """One line per comparison that ran, wrapped to ``width``: "a / b: x1.23 at 1MiB, …"."""
    out: list[str] = []
    for method, baseline, ratios in comparisons(results):
        pieces = [f"{_fmt_ratio(ratio)} at {fmt_size(size)}" for size, ratio in ratios]
        out += _wrapped(f"{method} / {baseline}:", pieces, width)
    return out


def _wrapped(head: str, pieces: Sequence[str], width: int) -> list[str]:
    """``head`` and the comma-separated ``pieces``, wrapped to ``width`` between pieces."""
    out: list[str] = []
    line = head
    for k, piece in enumerate(pieces):
        piece += "," if k < len(pieces) - 1 else ""
        if len(line) + 1 + len(piece) > width:
            out.append(line)
            line = "   "
        line += " " + piece
    out.append(line)
    return out


def _render_rounds(rounds: Sequence[RoundRatios], width: int) -> list[str]:
    """Per method over its baseline: the median of the per-round ratios and their range."""
    n = max(len(r.ratios) for r in rounds)
    out = [
        f"ratios per round ({n} rounds, both sides of each in the same round): "
        "median [lowest-highest]"
    ]
    by_pair: dict[tuple[str, str, int | None], list[RoundRatios]] = {}
    for r in rounds:
        by_pair.setdefault((r.method, r.baseline, r.rtt_ns), []).append(r)
    for (method, baseline, rtt), cells in by_pair.items():
        pieces = [
            f"{_fmt_ratio(c.median)} [{_fmt_ratio(c.low)[1:]}-{_fmt_ratio(c.high)[1:]}]"
            f" at {fmt_size(c.size)}"
            for c in cells
        ]
        modelled = "" if rtt is None else f" modelled at {_rtt.rtt_label(rtt)}"
        out += _wrapped(f"{method} / {baseline}{modelled}:", pieces, width)
    return out


# The method column of the detail tables: wide enough for every name that ran,
# so two names with one prefix (relayd-mooncake-late, -view) stay apart.
NAME_W, NAME_W_MAX = 17, 22


def _name_width(methods: Iterable[str]) -> int:
    return min(max([NAME_W - 1, *map(len, methods)]) + 1, NAME_W_MAX)


def _render_details(results: Sequence[Result], width: int) -> list[str]:
    w = _name_width(r.method for r in results)
    out = [
        f"{'size':<7}{'method':<{w}}{'median':>9}{'p99':>9}{'GB/s':>7}{'xfloor':>7}"
        f"  {'CPU µs w/r/d':<17}{'d wk':<6}{'flt w/r':<10}via"
    ]
    # a method that did not run at any size, for one reason, gets one line instead of one per size
    whole: dict[str, Result] = {}
    for m in _ordered(r.method for r in results):
        rows = [r for r in results if r.method == m]
        if len({(r.status, r.reason) for r in rows}) == 1 and rows[0].status is not Status.OK:
            whole[m] = rows[0]
    for size in sorted({r.size for r in results}):
        first = True
        for r in results:
            if r.size != size or r.method in whole:
                continue
            lead = f"{fmt_size(size) if first else '':<7}{r.method[: w - 1]:<{w}}"
            first = False
            if r.status is not Status.OK or r.latency is None:
                out.append(_clip(f"{lead}{r.status.value}: {r.reason}", width))
                continue
            out.append(
                _clip(
                    f"{lead}{fmt_ns(r.latency.median_ns):>9}{fmt_ns(r.latency.p99_ns):>9}"
                    f"{_fmt_gbps(r.gbps):>7}"
                    f"{_fmt_ratio(r.ratio_vs_floor):>7}  {_cpu_cell(r.cpu):<17}"
                    f"{_wakeup_cell(r.cpu):<6}{_flt_cell(r.cpu):<10}{_note(r.extra)}",
                    width,
                )
            )
    for m, r in whole.items():
        out.append(_clip(f"{'all':<7}{m[: w - 1]:<{w}}{r.status.value}: {r.reason}", width))
    return out


def fmt_split(split: Split) -> str:
    """``send/trip/recv`` in whole µs (see :class:`Split`)."""
    return "/".join(f"{ns / 1e3:.0f}" for ns in (split.send_ns, split.trip_ns, split.recv_ns))


def _render_splits(results: Sequence[Result], width: int) -> list[str]:
    """Each pair method's median split into its sides, a method x size matrix."""
    cells = {(r.method, r.size): fmt_split(r.split) for r in results if r.split is not None}
    if not cells:
        return []
    methods = _ordered(m for m, _ in cells)
    head = [
        "",
        "where the time went, median µs: the writer's side (relayd: put, DataRef to bytes) /",
        "the trip to the reader / the reader's side (relayd: DataRef from bytes, get);",
        "each part's own median",
    ]
    cell_w = max(map(len, cells.values())) + 2
    return head + _by_size(methods, cells, _name_width(methods), cell_w, width, str.rjust)


def _render_round_trips(results: Sequence[Result]) -> list[str]:
    """Round trips counted per read, and the latency they model at real networks' RTTs."""
    rows = [
        (r.method, r.size, r.latency.median_ns, rt)
        for r in results
        if r.latency is not None and (rt := _rtt.parse_rt(r.extra)) is not None
    ]
    if not rows:
        return []
    reads = {(r.method, r.size): r.extra.get("reads", "-") for r in results}
    bounds = {
        (r.method, r.size): b
        for r in results
        if (b := _rtt.parse_rt(r.extra, _rtt.EXTRA_RT_BOUND)) is not None
    }
    rtts = "".join(f"{_rtt.rtt_label(x):>11}" for x in _rtt.MODEL_RTTS_NS)
    w = _name_width(method for method, *_ in rows)
    out = [
        "",
        "RT: round trips a read waits for, put returned -> get returned (the DataRef's trip",
        "included); modelled latency = median + RT x RTT;",
        "reads: landed/awaited/pulled/attached/announced (see relayd_bench._rtt);",
        "RT+: every push awaited, as at an RTT above the slack a landed read had here",
        f"{'size':<7}{'method':<{w}}{'median':>9}{'RT':>6}{'RT+':>6}{rtts}  reads",
    ]
    modelled_at: dict[tuple[str, int], list[float]] = {}
    medians: dict[tuple[str, int], float] = {}
    for method, size, med, rt, modelled in _rtt.model_rows(rows):
        modelled_at[method, size] = modelled
        medians[method, size] = med
        cells = "".join(f"{fmt_ns(v):>11}" for v in modelled)
        bound = bounds.get((method, size), rt)
        head = f"{fmt_size(size):<7}{method[: w - 1]:<{w}}{fmt_ns(med):>9}{rt:>6.2f}{bound:>6.2f}"
        out.append(f"{head}{cells}  {reads[method, size]}")
    for method, baseline in COMPARISONS:
        for size in sorted(s for m, s in modelled_at if m == method):
            base = modelled_at.get((baseline, size))
            if base is None:
                continue
            ratios = [
                f"{_fmt_ratio(a / b)} at {_rtt.rtt_label(x)[4:]}"
                for a, b, x in zip(modelled_at[method, size], base, _rtt.MODEL_RTTS_NS, strict=True)
            ]
            out.append(f"{method} / {baseline} modelled, {fmt_size(size)}: {', '.join(ratios)}")
            upper_rt = bounds.get((method, size))
            if upper_rt is not None:
                med = medians[method, size]
                upper = [
                    f"{_fmt_ratio(_rtt.modelled_ns(med, upper_rt, x) / b)}"
                    for b, x in zip(base, _rtt.MODEL_RTTS_NS, strict=True)
                ]
                out.append(f"   with RT+: {', '.join(upper)}")
    return out


def _pairs(streams: Sequence[StreamResult]) -> str:
    """Which process pairs carried the streams, as the header's next words."""
    counts = {r.pairs for r in streams}
    if len(counts) > 1:
        each = ", ".join(f"{r.method} {r.pairs}" for r in streams)
        return f"; writer/reader process pairs: {each}"
    n = counts.pop()
    return " in one writer/reader process pair" if n == 1 else f" in {n} process pairs"


def _render_streams(streams: Sequence[StreamResult], width: int) -> list[str]:
    s0 = streams[0]
    w = _name_width(r.method for r in streams)
    out = [
        f"stream: {s0.streams} streams x {fmt_size(s0.chunk_size)} at {s0.rate_hz:g}/s each"
        f"{_pairs(streams)}; latency from each chunk's scheduled send time",
        f"{'method':<{w}}{'chunks':>7}{'p50':>8}{'p99':>8}{'max':>8}{'rate/s (target)':>16}"
        f"{'GB/s':>6}{'xfloor':>7}  {'CPU µs w/r/d':<16}{'d wk':<6}via",
    ]
    for r in streams:
        lead = f"{r.method[: w - 1]:<{w}}"
        if r.status is not Status.OK or r.latency is None:
            out.append(_clip(f"{lead}{r.status.value}: {r.reason}", width))
            continue
        rate = f"{r.aggregate_chunks_per_s or 0:.0f} ({r.target_chunks_per_s:.0f})"
        out.append(
            _clip(
                f"{lead}{r.chunks:>7}{fmt_ns(r.latency.median_ns):>8}"
                f"{fmt_ns(r.latency.p99_ns):>8}{fmt_ns(r.latency.max_ns):>8}{rate:>16}"
                f"{_fmt_gbps(r.aggregate_gbps):>6}"
                f"{_fmt_ratio(r.ratio_vs_floor):>7}  {_cpu_cell(r.cpu):<16}"
                f"{_wakeup_cell(r.cpu):<6}{_note(r.extra)}",
                width,
            )
        )
    worst = [r for r in streams if r.worst_by_second_ns]
    if worst:
        out.append("worst latency per second (one stall: one high second; queueing: many)")
        for r in worst:
            seconds = " ".join(fmt_ns(ns) for ns in r.worst_by_second_ns)
            out.append(_clip(f"  {r.method[:15]:<16}{seconds}", width))
    return out
