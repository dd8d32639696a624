"""A relayd daemon as a child process: start it, know when it serves, stop it.

The one way the demo, the benchmark and the tests start a daemon of their own.
:class:`DaemonProcess` holds the command line (``python -m relayd serve`` plus
flags built from setting names, behind an optional prefix such as
``ip netns exec NS`` or ``setpriv --reuid=...``), the environment and where the
daemon's output goes. ``start()`` returns once the standard gRPC health service
on its socket answers SERVING, polled until a deadline; a daemon that exits or
misses the deadline is killed and reported with its exit code and the end of
its log (:class:`DaemonStartError`). ``stop()`` sends SIGTERM (the daemon
drains and unlinks its segments), waits up to a deadline, then SIGKILLs.

Nothing here configures logging or imports the daemon's parts: a process that
only launches daemons stays light.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .config import Settings

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
KILL_WAIT_S = 10.0
POLL_S = 0.02
HEALTH_CALL_S = 1.0
LOG_TAIL_CHARS = 8000

_SETTINGS = frozenset(f.name for f in dataclasses.fields(Settings))


class DaemonStartError(RuntimeError):
    """The daemon exited or did not serve in time; the message says why, with its log."""


def serve_argv(
    socket: str | None,
    *args: str,
    settings: Mapping[str, object] | None = None,
    prefix: Sequence[str] = (),
) -> list[str]:
    """``[*prefix, python, -m, relayd, serve, --socket S, --<setting> V..., *args]``.

    ``settings`` are ``Settings`` field names (``shm_pool_size="64MiB"``); their
    flags are spelled as ``config.add_arguments`` derives them. ``socket=None``
    leaves the daemon on its embedded default.
    """
    argv = [*prefix, sys.executable, "-m", "relayd", "serve"]
    if socket is not None:
        argv += ["--socket", socket]
    for name, value in (settings or {}).items():
        if name not in _SETTINGS:
            raise ValueError(f"relayd serve has no setting {name!r}")
        argv += ["--" + name.replace("_", "-"), str(value)]
    return [*argv, *args]


def health(socket: str) -> str:
    """'' when the daemon on ``socket`` answers SERVING, else why not."""
    if not os.path.exists(socket):
        return "socket not created"
    try:
        with grpc.insecure_channel(f"unix:{socket}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_CALL_S
            )
    except grpc.RpcError as exc:
        return f"health check: {exc.code().name}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"health: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return ""


def wait_serving(
    socket: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Return once ``socket`` serves; :class:`DaemonStartError` when ``proc`` exits or
    ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise DaemonStartError(f"relayd serve exited with code {proc.returncode}")
        why = health(socket)
        if not why:
            return
        if time.monotonic() > deadline:
            raise DaemonStartError(f"relayd not serving on {socket} after {timeout_s:g} s ({why})")
        time.sleep(POLL_S)


@dataclasses.dataclass(eq=False)  # a handle on one process: equal only to itself
class DaemonProcess:
    """One daemon child. Fields may be changed until ``start()``.

    ``log_path``: the daemon's stdout and stderr, appended (None: the caller's own).
    ``env``: its whole environment (None: the caller's). ``new_session``: its own
    session, so a Ctrl-C at the terminal reaches only the caller, which then stops
    it cleanly.
    """

    socket: str
    argv: list[str]
    env: dict[str, str] | None = None
    log_path: str | None = None
    new_session: bool = False
    proc: subprocess.Popen[bytes] | None = None
    killed: bool = False  # stop() had to SIGKILL it

    @classmethod
    def serve(
        cls,
        socket: str,
        *args: str,
        settings: Mapping[str, object] | None = None,
        prefix: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        log_path: str | None = None,
        new_session: bool = False,
    ) -> DaemonProcess:
        """A daemon serving on ``socket`` (see :func:`serve_argv`), not started yet."""
        env = {**os.environ, **extra_env} if extra_env else None
        argv = serve_argv(socket, *args, settings=settings, prefix=prefix)
        return cls(socket, argv, env=env, log_path=log_path, new_session=new_session)

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("the daemon was not started")
        return self.proc.pid

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start the process without waiting for it to serve."""
        with contextlib.ExitStack() as stack:
            out = None
            if self.log_path is not None:  # the child keeps its own descriptor
                out = stack.enter_context(open(self.log_path, "ab"))
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
                env=self.env,
                start_new_session=self.new_session,
            )
        return self.proc

    def wait_serving(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until it serves; otherwise kill it and raise with its exit code and log."""
        try:
            wait_serving(self.socket, timeout_s, self.proc)
        except DaemonStartError as exc:
            self.kill()
            tail = self.log_tail()
            raise DaemonStartError(f"{exc}\n{tail}" if tail else str(exc)) from None
        except BaseException:
            self.kill()
            raise

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> DaemonProcess:
        self.spawn()
        self.wait_serving(timeout_s)
        return self

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        """The end of the daemon's log ('' when it logs to the caller's output)."""
        if self.log_path is None:
            return ""
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as fh:
            return fh.read()[-chars:]
        return ""

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        """Signal it without waiting, so several daemons drain at once."""
        if self.running():
            assert self.proc is not None
            self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """``sig`` (SIGTERM: drain), wait up to ``timeout_s``, then SIGKILL; the exit code."""
        if self.proc is None:
            return 0
        self.terminate(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.killed = True
            return self.kill()

    def kill(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait(timeout=KILL_WAIT_S)

    def __enter__(self) -> DaemonProcess:
        return self.start() if self.proc is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
