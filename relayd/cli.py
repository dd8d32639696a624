"""``relayd`` command line: serve, status, leases, top, drain, health, demo, bench.

Only this module configures logging; library modules just log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import __version__, config

if TYPE_CHECKING:
    from google.protobuf.message import Message

EXIT_CONFIG = 2
# A reader that closes the pipe early (`relayd status | head`): exit as if by
# SIGPIPE, as other command-line tools do.
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE
# `drain --wait`: beyond the grace, the daemon closes its servers and unmaps.
DRAIN_WAIT_MARGIN = 30.0


def _client_socket(args: argparse.Namespace) -> str:
    return str(args.socket or config.load({}, environ=None).socket)


def _json_text(value: Message | Sequence[Message], *, indent: int | None = 2) -> str:
    """``--json`` output of a Status reply or of some of its leases: numbers as numbers,
    enum values by their short names."""
    from google.protobuf.message import Message

    from .status_view import to_plain

    if isinstance(value, Message):
        plain: Any = to_plain(value)
    else:
        plain = [to_plain(x) for x in value]
    return json.dumps(plain, indent=indent, sort_keys=True)


def _unreachable_message(socket_path: str, exc: BaseException) -> str:
    """What the client library would say, never a raw gRPC error object."""
    import grpc
    from relayd_client.wire.errors import DaemonUnavailableError, RelayError
    from relayd_client.wire.status import from_rpc_error

    if not os.path.exists(socket_path):
        return (
            f"no relayd socket at {socket_path}; start the daemon with `relayd serve` "
            "or name its socket with --socket (or RELAYD_SOCKET)"
        )
    err = from_rpc_error(exc) if isinstance(exc, grpc.RpcError) else exc
    if isinstance(err, DaemonUnavailableError):
        return f"no relayd answers on {socket_path} ({err}); start it with `relayd serve`"
    if isinstance(err, RelayError):
        return f"{type(err).__name__} from relayd on {socket_path}: {err}"
    return f"cannot reach relayd on {socket_path}: {err}"


def _fail_unreachable(socket_path: str, exc: BaseException) -> int:
    print(f"relayd: {_unreachable_message(socket_path, exc)}", file=sys.stderr)
    return 1


def cmd_serve(args: argparse.Namespace) -> int:
    from relayd_client.wire.errors import RelayError

    from . import _logging, preflight
    from ._systemd import SystemdNotifier
    from .loops import loop_factory
    from .rundir import SocketInUseError, UnsafeRuntimeDirError
    from .server import Daemon

    flags = {
        k: v
        for k, v in vars(args).items()
        if k in {f for f in config.Settings.__dataclass_fields__}
    }
    try:
        settings = config.load(flags, config_file=args.config)
    except config.ConfigError as exc:
        print(f"relayd: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    _logging.configure(settings.log_format, settings.log_level)
    from .pools.arena import remove_stale_segments

    # A dead daemon's segments are free space for the /dev/shm check.
    remove_stale_segments()
    try:
        preflight.check_all(settings)
    except preflight.PreflightError as exc:
        print(f"relayd: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    advice = preflight.small_shm_advice(settings)
    if advice:
        logging.getLogger("relayd").warning("%s", advice)
    import os

    daemon = Daemon(settings, notifier=SystemdNotifier.from_environ(os.environ))
    try:
        with asyncio.Runner(loop_factory=loop_factory(settings.loop)) as runner:
            rc = runner.run(daemon.run())
        # Drained and unlinked: a late signal must not turn exit 0 into a kill.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return rc
    except (SocketInUseError, UnsafeRuntimeDirError, preflight.PreflightError) as exc:
        # PreflightError: a port taken between preflight and the bind.
        print(f"relayd: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except RelayError as exc:  # peer settings, Mooncake start-up: the message says what to fix
        print(f"relayd: cannot start: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as exc:
        logging.getLogger("relayd").debug("start failed", exc_info=True)
        print(f"relayd: cannot start: {exc!r}", file=sys.stderr)
        return 1


def cmd_status(args: argparse.Namespace) -> int:
    from .status_view import fetch_status, status_dict

    path = _client_socket(args)
    try:
        reply = fetch_status(path)
    except Exception as exc:
        return _fail_unreachable(path, exc)
    if args.json:
        print(_json_text(reply))
    else:
        from .status_tables import render_status

        print(render_status(status_dict(reply)))
    return 0


def cmd_leases(args: argparse.Namespace) -> int:
    from .status_view import fetch_status, status_dict

    path = _client_socket(args)
    try:
        reply = fetch_status(path)
    except Exception as exc:
        return _fail_unreachable(path, exc)
    leases = sorted(reply.leases, key=lambda x: -x.age_seconds)
    if args.stage:
        leases = [x for x in leases if args.stage in (x.from_stage, x.to_stage)]
    if args.request:
        leases = [x for x in leases if x.request_id == args.request]
    if args.json:
        print(_json_text(leases))
    else:
        from .status_tables import render_leases

        print(render_leases(status_dict(reply), args.stage, args.request))
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    from . import top
    from .status_view import fetch_status

    path = _client_socket(args)
    return top.run(
        lambda: fetch_status(path),
        path,
        interval=args.interval,
        iterations=args.iterations,
        to_json=(lambda d: _json_text(d, indent=None)) if args.json else None,
        unreachable=lambda exc: _unreachable_message(path, exc),
    )


def _daemon_gone(socket_path: str) -> bool:
    """The daemon removed its socket and let go of the lock beside it (its last steps)."""
    import fcntl

    if os.path.exists(socket_path):
        return False
    try:
        fd = os.open(socket_path + ".lock", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def cmd_drain(args: argparse.Namespace) -> int:
    from .operator import operator_session

    path = _client_socket(args)
    try:
        with operator_session(path, 5) as op:
            resp = op.drain(args.grace or 0, 5)
    except Exception as exc:
        return _fail_unreachable(path, exc)
    from .rpc.service import MAX_DRAIN_GRACE

    # A daemon older than DrainResponse.grace_seconds leaves it 0: wait up to the
    # longest grace it could apply.
    grace = resp.grace_seconds or args.grace or MAX_DRAIN_GRACE
    shown = f"up to {grace:g}s" if resp.grace_seconds or args.grace else "its drain grace"
    print(f"relayd on {path}: draining; leases in flight get {shown} to be read")
    if not args.wait:
        return 0
    deadline = time.monotonic() + grace + DRAIN_WAIT_MARGIN
    while not _daemon_gone(path):
        if time.monotonic() > deadline:
            print(
                f"relayd: still running on {path} {grace + DRAIN_WAIT_MARGIN:g}s later",
                file=sys.stderr,
            )
            return 1
        time.sleep(0.1)
    print(f"relayd on {path}: stopped")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = args.address or f"unix:{_client_socket(args)}"
    try:
        with grpc.insecure_channel(target) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=args.timeout
            )
    except Exception as exc:
        if not args.address:
            return _fail_unreachable(_client_socket(args), exc)
        from relayd_client.wire.status import from_rpc_error

        err = from_rpc_error(exc) if isinstance(exc, grpc.RpcError) else exc
        print(f"relayd: health check on {target} failed: {err}", file=sys.stderr)
        return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(name)
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(
        socket=args.socket, chunks=args.chunks, chunk_bytes=config.parse_size(args.chunk_size)
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relayd", description="Per-node tensor relay daemon")
    parser.add_argument("--version", action="version", version=f"relayd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon (embedded default with no flags)")
    config.add_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    def client_cmd(name: str, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument(
            "--socket", metavar="PATH", help="daemon socket (default: the embedded default)"
        )
        return p

    st = client_cmd("status", "pools, leases, sessions, peers")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    ls = client_cmd("leases", "leases, oldest first")
    ls.add_argument("--stage")
    ls.add_argument("--request")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_leases)

    top = client_cmd("top", "live view per edge, refreshed every second; q quits")
    top.add_argument("--interval", type=float, default=1.0)
    top.add_argument("--iterations", type=int, default=0, help="stop after N refreshes (0: never)")
    top.add_argument("--json", action="store_true")
    top.set_defaults(func=cmd_top)

    dr = client_cmd("drain", "drain and stop the daemon (same as SIGTERM)")
    dr.add_argument(
        "--grace",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="how long in-flight leases may still be read (default: the daemon's drain_grace)",
    )
    dr.add_argument("--wait", action="store_true", help="return once the daemon has stopped")
    dr.set_defaults(func=cmd_drain)

    he = client_cmd("health", "exit 0 when the daemon is SERVING")
    he.add_argument("--address", help="TCP health address instead of the socket (HOST:PORT)")
    he.add_argument("--timeout", type=float, default=3.0)
    he.set_defaults(func=cmd_health)

    de = client_cmd("demo", "start a daemon and stream thinker -> talker through it")
    de.add_argument("--chunks", type=int, default=50)
    de.add_argument("--chunk-size", default="1MiB")
    de.set_defaults(func=cmd_demo)

    be = sub.add_parser("bench", help="benchmark against the copy floor", add_help=False)
    be.set_defaults(func=None)
    return parser


def _bench(argv: list[str]) -> int:
    # The benchmark is its own package, shipped beside the daemon but never part of its
    # run time: only this subcommand imports it.
    try:
        from relayd_bench import main as bench_main
    except ModuleNotFoundError as exc:
        if exc.name != "relayd_bench":
            raise
        print(
            "relayd bench: the relayd_bench package is not installed; "
            "install relayd with its bench extra: pip install '.[bench]'",
            file=sys.stderr,
        )
        return 2
    return bench_main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = int(args.func(args))
        sys.stdout.flush()
    except BrokenPipeError:
        # Python would report the failed flush at exit; stdout goes nowhere now.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return rc
