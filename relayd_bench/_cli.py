"""``relayd bench``: command line, then run, table, JSON and plot."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from relayd_bench import _netns, _plot, _registry
from relayd_bench._progress import Progress
from relayd_bench._rounds import round_ratios
from relayd_bench._run import Bench, Options, plan_for
from relayd_bench._stats import (
    Status,
    add_ratios,
    add_stream_ratios,
    machine_info,
    result_json,
    to_json,
)
from relayd_bench._table import render_table

DEFAULT_SIZES = "4K,256K,1M,4M,16M"
DEFAULT_NETNS_RATE = "10gbit"
_RATE_RE = re.compile(r"^\d+(?:\.\d+)?(?:[kmgt]?(?:bit|bps))$", re.IGNORECASE)
QUICK_SCALE = 0.1
QUICK_STREAMS, QUICK_STREAM_SECONDS, QUICK_STREAM_WARMUP_S = 2, 1.0, 0.2
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Binary units, as payload sizes are quoted: 4K = 4KiB = 4096; a bare number is bytes."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 4K, 256KiB, 1M, 16MiB, 65536)")
    shift = {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]
    return int(float(m.group(1)) * (1 << shift))


def parse_sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(parse_size(p) for p in text.split(",") if p.strip())
    if not sizes:
        raise ValueError("no sizes given")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="relayd bench",
        description="Measure tensor hand-off between two processes: relayd against its baselines "
        "(stop-and-wait one-way latency, as in the reference measurements).",
    )
    p.add_argument(
        "--sizes", default=DEFAULT_SIZES, help=f"payload sizes (default {DEFAULT_SIZES})"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="~1/10 of the iterations, one process "
        "pair per method, short streams: a smoke run in well under a minute",
    )
    p.add_argument(
        "--methods",
        help="comma list of methods, 'baselines', 'relayd' or 'all' "
        f"(default all): {', '.join(_registry.known_names())}",
    )
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write a PNG (needs matplotlib)")
    p.add_argument(
        "--socket", metavar="PATH", help="use this running daemon instead of starting one"
    )
    p.add_argument(
        "--reader-socket",
        metavar="PATH",
        help="relayd-mooncake: the reader's daemon on another node, Mooncake peer of "
        "--socket's (default: the bench starts both daemons on loopback)",
    )
    p.add_argument(
        "--iterations-scale",
        type=float,
        metavar="FLOAT",
        help=f"multiply warm-up and measured counts (default 1, {QUICK_SCALE} with --quick)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="N",
        help="run every method and size N times, the methods' order reversed every other "
        "round; the table shows each cell's median round and adds each ratio's median "
        "over the rounds with its range (default 1). The stream workload runs once",
    )
    p.add_argument(
        "--reuse-processes",
        action="store_true",
        help="one process pair per method for all sizes (implied by --quick)",
    )
    p.add_argument(
        "--streams",
        type=int,
        help="stream workload: concurrent streams (default 16, a thinker->talker fan-in)",
    )
    p.add_argument(
        "--stream-pairs",
        type=int,
        default=1,
        metavar="N",
        help="stream workload: writer/reader process pairs that carry the streams "
        "(default 1: one writer and one reader process, as a thinker and a talker, each "
        "stream a task on its event loop or, for a blocking method, a thread; N = "
        "--streams: a process pair per stream)",
    )
    p.add_argument(
        "--stream-rate",
        type=float,
        default=50.0,
        metavar="HZ",
        help="stream workload: chunks per second per stream (default 50)",
    )
    p.add_argument(
        "--stream-size",
        default="1M",
        metavar="SIZE",
        help="stream workload: bytes per chunk (default 1M; the cross-node hidden-state "
        "stream is --stream-methods relayd-mooncake --stream-size 256K)",
    )
    p.add_argument(
        "--stream-seconds", type=float, help="stream workload: measured seconds (default 5)"
    )
    p.add_argument(
        "--stream-methods",
        default=",".join(_registry.DEFAULT_STREAM_METHODS),
        help="methods the stream workload runs (default %(default)s)",
    )
    p.add_argument(
        "--netns",
        action="store_true",
        help="root only: run the two daemons, and the writer and reader of the cross-node "
        "methods (relayd-mooncake, mooncake-raw), in two network namespaces joined by a "
        "veth pair; the DataRefs cross the same link over TCP. The table adds the round "
        "trips each read waits for and the latency they model at 50 us, 200 us, 1 ms RTT",
    )
    p.add_argument(
        "--netns-rate",
        default=DEFAULT_NETNS_RATE,
        metavar="RATE",
        help="with --netns: the veth's rate, a tc tbf rate such as 10gbit "
        "(default %(default)s; 'none': unshaped)",
    )
    p.add_argument("--shm-pool-size", default="512MiB", help="arena of the daemon the bench starts")
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="give up on one process pair after this long (default 600)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    p.add_argument("--list", action="store_true", help="list the methods and exit")
    p.add_argument("--gpu", action="store_true", help="run the GPU benchmarks instead")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="with --gpu: after the measured transfers, profile a few more on each side "
        "(cProfile) and write <method>-put.txt and <method>-get.txt to DIR; otherwise: run "
        "the daemons the bench starts under cProfile and write DIR/<daemon>.txt, their "
        "functions per transfer (and DIR/<daemon>.prof, for pstats)",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="the cross-node methods (relayd-mooncake...) run with probes in their four "
        "processes, and a table per method and size says where a transfer's time went, "
        "hop by hop (each probe costs ~2 us: the run's own medians come out higher); "
        "one process pair per method and size, as without --quick",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="instead: time each step of a put and a get of both clients, in one process, "
        "back to back and after 1 ms asleep (per --sizes; with --quick, fewer transfers)",
    )
    return p


def _options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Options:
    try:
        sizes = parse_sizes(args.sizes)
        methods = tuple(_registry.select(args.methods))
        stream_methods = tuple(_registry.select(args.stream_methods))
        stream_chunk = parse_size(args.stream_size)
    except ValueError as exc:
        parser.error(str(exc))
    if _registry.STREAM in stream_methods:
        parser.error("--stream-methods takes methods, not the stream workload itself")
    scale = args.iterations_scale
    if scale is None:
        scale = QUICK_SCALE if args.quick else 1.0
    if scale <= 0:
        parser.error("--iterations-scale must be > 0")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    streams = args.streams if args.streams is not None else QUICK_STREAMS if args.quick else 16
    seconds = args.stream_seconds
    if seconds is None:
        seconds = QUICK_STREAM_SECONDS if args.quick else 5.0
    if streams < 1 or args.stream_pairs < 1 or args.stream_rate <= 0 or seconds <= 0:
        parser.error(
            "--streams, --stream-pairs, --stream-rate and --stream-seconds must be positive"
        )
    if args.netns:
        if args.socket or args.reader_socket:
            parser.error("--netns starts its own daemons: not with --socket/--reader-socket")
        try:
            _netns.check_available()
        except _netns.NetnsUnavailable as exc:
            parser.error(f"--netns: {exc}")
    for flag, on in (("--timeline", args.timeline), ("--profile", args.profile)):
        if on and (args.socket or args.reader_socket):
            parser.error(f"{flag} starts its own daemons: not with --socket/--reader-socket")
    if args.profile and (args.timeline or args.breakdown):
        parser.error(
            "--profile: not with --timeline or --breakdown (each runs the daemons its way)"
        )
    if args.profile:
        try:
            os.makedirs(args.profile, exist_ok=True)
        except OSError as exc:
            parser.error(f"--profile: {exc}")
    rate = None if args.netns_rate.lower() == "none" else args.netns_rate
    if rate is not None and not _RATE_RE.match(rate):
        parser.error(f"--netns-rate: not a tc rate: {rate!r} (examples: 10gbit, 800mbit)")
    return Options(
        sizes=sizes,
        methods=methods,
        scale=scale,
        # A writer's probes say which method and size they timed: one per process.
        reuse_processes=(args.quick or args.reuse_processes) and not args.timeline,
        socket=args.socket,
        reader_socket=args.reader_socket,
        shm_pool_size=args.shm_pool_size,
        job_timeout_s=args.timeout,
        streams=streams,
        stream_pairs=args.stream_pairs,
        stream_rate=args.stream_rate,
        stream_chunk=stream_chunk,
        stream_seconds=seconds,
        stream_warmup_s=QUICK_STREAM_WARMUP_S if args.quick else 0.5,
        stream_methods=stream_methods,
        netns=args.netns,
        netns_rate=rate,
        rounds=args.rounds,
        timeline=args.timeline,
        profile_dir=os.path.abspath(args.profile) if args.profile else None,
    )


def _list_methods() -> None:
    w = _registry.NAME_WIDTH
    for e in (*_registry.BASELINES, *_registry.RELAYD):
        print(f"{e.name:<{w}}{e.summary}")
    print(f"{_registry.STREAM:<{w}}N paced streams of --stream-size chunks (see --stream-*)")


def _run_gpu(args: argparse.Namespace) -> int:
    try:
        from relayd_bench import gpu
    except ImportError as exc:
        print(f"relayd bench --gpu: GPU benchmarks unavailable: {exc}", file=sys.stderr)
        return 2
    return gpu.run(args)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through Bench.close(): children, daemon, segments


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        _list_methods()
        return 0
    if args.gpu:
        return _run_gpu(args)
    opts = _options(args, parser)
    if args.breakdown:
        from relayd_bench import _breakdown

        sys.stdout.write(_breakdown.run(opts.sizes, opts.scale, opts.socket, opts.shm_pool_size))
        return 0
    if args.plot:
        try:
            _plot.check_available()
        except _plot.PlotUnavailable as exc:
            print(f"relayd bench: {exc}", file=sys.stderr)
            return 2
    progress = Progress(enabled=not args.no_progress)
    bench = Bench(opts, progress)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        bench.run()
    except KeyboardInterrupt:
        print("\nrelayd bench: interrupted", file=sys.stderr)
        return 130
    except _netns.NetnsUnavailable as exc:
        print(f"relayd bench: --netns: {exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
        bench.close()
    for cells in bench.rounds:
        add_ratios(cells)  # each round's cells against that round's floor
    add_ratios(bench.results)
    add_stream_ratios(bench.streams)
    machine = {**machine_info(), "loadavg_at_start": bench.loadavg_at_start}
    if bench.cold_call is not None:
        machine["cold_call"] = dataclasses.asdict(bench.cold_call)
    if bench.wake is not None:
        machine["wake"] = dataclasses.asdict(bench.wake)
    if bench.handoff is not None:
        machine["handoff"] = dataclasses.asdict(bench.handoff)
    per_round = round_ratios(bench.rounds) if opts.rounds > 1 else []
    sys.stdout.write(render_table(bench.results, bench.streams, machine, rounds=per_round))
    network = bench.network_line()
    if network:
        sys.stdout.write(network + "\n")
    if bench.timeline:
        sys.stdout.write("\n" + bench.timeline)
    if bench.profiles:
        sys.stdout.write("daemon profiles: " + " ".join(map(str, bench.profiles)) + "\n")
    elif opts.profile_dir:
        sys.stdout.write("daemon profiles: none (the bench started no daemon, or one was killed)\n")
    if args.json:
        run = {
            "argv": list(argv) if argv is not None else sys.argv[1:],
            "sizes": list(opts.sizes),
            "methods": list(opts.methods),
            "quick": args.quick,
            "iterations_scale": opts.scale,
            "reuse_processes": opts.reuse_processes,
            "netns": opts.netns,
            "netns_rate": opts.netns_rate if opts.netns else None,
            "rounds": opts.rounds,
            "plan": [vars(plan_for(s, opts.scale)) for s in opts.sizes],
            "stream": {
                "streams": opts.streams,
                "process_pairs": opts.stream_pairs,
                "rate_hz": opts.stream_rate,
                "seconds": opts.stream_seconds,
                "methods": list(opts.stream_methods),
            },
            **bench.describe(),
        }
        with open(args.json, "w", encoding="utf-8") as f:
            doc = to_json(bench.results, bench.streams, machine, run)
            if opts.rounds > 1:
                doc["rounds"] = {
                    "ratios": [r.to_json() for r in per_round],
                    "results": [[result_json(r) for r in cells] for cells in bench.rounds],
                }
            json.dump(doc, f, indent=2)
            f.write("\n")
    if args.plot:
        _plot.write_plot(args.plot, bench.results, machine)
    failed = any(r.status is Status.FAILED for r in bench.results) or any(
        s.status is Status.FAILED for s in bench.streams
    )
    return 1 if failed else 0
