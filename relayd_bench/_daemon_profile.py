"""``relayd bench --profile DIR`` without ``--gpu``: the daemons' own Python, per transfer.

The client's steps have ``--breakdown``; a daemon's are harder to see from
outside: its work is spread over the callbacks of one event loop, and a
sampling profiler attached to it mostly sees the loop's C code. So the bench
starts each daemon it runs through this module::

    python -m relayd_bench._daemon_profile DIR python -m relayd serve --socket S ...

which runs relayd, profiled by :mod:`cProfile` from the end of its start-up
until it is told to stop, and, when it exits (the bench stops it with SIGTERM
and it drains), writes ``DIR/<S's name>.prof``. After the
run the bench turns each into ``DIR/<S's name>.txt`` (:func:`report`): the
daemon's functions called at least once every other transfer, by their own
time and by their time with what they call, each per transfer the daemon
moved (its ``transfers_by_transport``, over the whole run, warm-ups
included). So a table reads as "this daemon spends N µs of Python and M
calls on each transfer, here". cProfile adds about a microsecond to every
call it times: the medians of a profiled run come out higher, and a step's
figures say where the time goes more than what it is without the profiler.
"""

from __future__ import annotations

import cProfile
import io
import pstats
from collections.abc import Callable, Sequence
from pathlib import Path

from relayd_bench._timeline import wrapper_args, wrapper_prefix

# As ``python -m`` runs it (its __name__ is "__main__" there).
MODULE = "relayd_bench._daemon_profile"
# Rows per table.
TOP = 30
# A function counts once it is called this often per transfer; less is setup,
# teardown or the loop itself.
MIN_CALLS_PER_TRANSFER = 0.5
PROFILE_SUFFIX = ".prof"
REPORT_SUFFIX = ".txt"
# A function's row: calls, own µs and µs with what it calls, each per transfer; where.
_Row = tuple[float, float, float, str]


def prefix(out_dir: Path) -> list[str]:
    """What starts a daemon under the profiler (``_daemon.start``'s ``prefix``)."""
    return wrapper_prefix(MODULE, out_dir)


def _name(socket: str) -> str:
    """What a daemon's profile and report are named after: its socket's name."""
    return Path(socket).stem


def profile_path(out_dir: Path, args: Sequence[str]) -> Path:
    """Where the daemon serving on ``--socket S`` in ``args`` writes its profile."""
    args = list(args)
    if "--socket" not in args or args.index("--socket") + 1 >= len(args):
        raise SystemExit("relayd_bench._daemon_profile: the daemon's --socket names its profile")
    return out_dir / (_name(args[args.index("--socket") + 1]) + PROFILE_SUFFIX)


def main(argv: Sequence[str] | None = None) -> int:
    """``DIR python -m relayd ARGS...``: run relayd, profiled while it serves; write
    its profile at exit."""
    out_dir, args = wrapper_args(MODULE, argv)
    path = profile_path(out_dir, args)
    # An earlier run's profile must not pass for this one's if this daemon is killed.
    path.unlink(missing_ok=True)
    from relayd import server
    from relayd.cli import main as relayd_main

    profile = cProfile.Profile()
    serve = server.Daemon.main_loop

    async def main_loop(self: server.Daemon) -> None:
        # From start-up's end to the stop: no imports or arena set-up in the
        # tables, which a short run's few transfers would not outweigh.
        profile.enable()
        try:
            await serve(self)
        finally:
            profile.disable()

    server.Daemon.main_loop = main_loop  # type: ignore[method-assign]
    try:
        return relayd_main(args)
    finally:
        profile.dump_stats(path)


def _where(key: tuple[str, int, str]) -> str:
    """``module.py:line(function)``, the file named from the package down."""
    filename, line, name = key
    if filename == "~":  # a built-in
        return name
    parts = Path(filename).parts
    for top in ("relayd", "relayd_client", "relayd_bench", "asyncio", "grpc"):
        if top in parts:
            parts = parts[len(parts) - parts[::-1].index(top) - 1 :]
            break
    else:
        parts = parts[-1:]
    return f"{'/'.join(parts)}:{line}({name})"


def report(profile: Path, transfers: int, title: str, top: int = TOP) -> str:
    """The text of ``profile`` per transfer (see the module); ``transfers``: what the
    daemon moved in the run (at least 1)."""
    per = max(transfers, 1)
    stats = pstats.Stats(str(profile), stream=io.StringIO())
    rows: list[_Row] = [
        (calls / per, own * 1e6 / per, cum * 1e6 / per, _where(key))
        for key, (_, calls, own, cum, _) in stats.stats.items()  # type: ignore[attr-defined]
        if calls / per >= MIN_CALLS_PER_TRANSFER
    ]
    head = (
        f"{title}: {transfers} transfers; functions called at least every other transfer, "
        "per transfer (cProfile: ~1 µs more a call)"
    )
    out = [head, f"calls {sum(r[0] for r in rows):.0f}, own time {sum(r[1] for r in rows):.1f} µs"]
    orders: tuple[tuple[str, Callable[[_Row], float]], ...] = (
        ("own", lambda r: -r[1]),
        ("with what it calls", lambda r: -r[2]),
    )
    for label, order in orders:
        out += ["", f"by {label} time", f"{'calls':>7} {'own µs':>8} {'cum µs':>8}  function"]
        for calls, own, cum, where in sorted(rows, key=order)[:top]:
            out.append(f"{calls:7.2f} {own:8.2f} {cum:8.2f}  {where}")
    return "\n".join(out) + "\n"


def write_reports(out_dir: Path, transfers: dict[str, int]) -> list[Path]:
    """``DIR/<name>.txt`` for each daemon profile ``DIR/<name>.prof``, of the daemons
    ``transfers`` gives by socket with what each moved; the reports written."""
    written = []
    for socket, moved in transfers.items():
        name = _name(socket)
        profile = out_dir / (name + PROFILE_SUFFIX)
        if not profile.exists():  # killed before it could write it
            continue
        path = out_dir / (name + REPORT_SUFFIX)
        path.write_text(report(profile, moved, f"daemon {name}"), encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    raise SystemExit(main())
