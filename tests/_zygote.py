"""Worker processes forked from one that has already imported torch and the client.

Every worker is still a process of its own: its own pid, pipes, signals and
death, a client in another process exactly as a stage worker is. What it does
not pay is the import: ``import torch`` costs ~2.5 s of CPU, and the suite
starts hundreds of workers on a two-core CI machine. One zygote per pytest
run imports the heavy modules once and forks each worker on request;
:func:`popen` returns a :class:`subprocess.Popen` for it, so the tests drive it
as they would any child (``wait``, ``kill``, ``communicate``, ``returncode``).

The zygote is the workers' parent, so it reaps them and reports each exit
status to the test process over the same socket. A worker starts with the
test process's environment and working directory of the moment, re-seeds
``random``, runs its module as ``__main__`` and exits the way the interpreter
would (non-daemon threads joined, ``atexit`` run, stdio flushed).

Set ``RELAYD_TEST_NO_ZYGOTE=1`` to start every worker with a fresh interpreter.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import random
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import Any

# What every worker imports anyway: paid once, in the zygote.
PRELOAD = ("torch", "relayd_client", "tests._workers", "tests._keyed_worker")
_MAX_MESSAGE = 1 << 20
_START_TIMEOUT = 120.0


# --- the test process's side --------------------------------------------------------


class _Ledger:
    """The zygote's reports as the test process keeps them: pids forked, exit codes.

    Pids wrap (at 32768 by default, threads' ids included), so a worker may get
    the pid of one that exited earlier. The zygote reports a new worker's pid
    before its exit, and the report clears the exit kept for that pid, or the
    new worker would be taken for exited with its predecessor's code (a writer
    once "exited" -9 as soon as it started).
    """

    def __init__(self) -> None:
        self.pids: list[int] = []  # forked, not yet handed to the caller
        self.exits: dict[int, int] = {}

    def record(self, msg: dict[str, int]) -> None:
        if "pid" in msg:
            self.pids.append(msg["pid"])
            self.exits.pop(msg["pid"], None)
        else:
            self.exits[msg["exit"]] = msg["code"]


class _Zygote:
    """The test process's handle on the zygote: fork requests, exit reports."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests._zygote", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        theirs.close()
        self._lock = threading.Lock()  # one fork request at a time
        self._cond = threading.Condition()
        self._ledger = _Ledger()
        self._gone = False
        ours.settimeout(_START_TIMEOUT)
        if json.loads(ours.recv(_MAX_MESSAGE)) != {"ready": True}:
            raise RuntimeError("the worker zygote did not start")
        ours.settimeout(None)
        threading.Thread(target=self._listen, name="zygote-exits", daemon=True).start()

    def _listen(self) -> None:
        while True:
            try:
                data = self._sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            with self._cond:
                if not data:
                    self._gone = True
                    self._cond.notify_all()
                    return
                self._ledger.record(json.loads(data))
                self._cond.notify_all()

    def fork(self, argv: Sequence[str], fds: Sequence[int], cwd: str) -> int:
        request = json.dumps({"argv": list(argv), "cwd": cwd, "env": dict(os.environ)})
        with self._lock:
            socket.send_fds(self._sock, [request.encode()], list(fds))
            with self._cond:
                pids = self._ledger.pids
                if not self._cond.wait_for(lambda: pids or self._gone, _START_TIMEOUT):
                    raise RuntimeError("the worker zygote did not answer a fork request")
                if not pids:
                    raise RuntimeError("the worker zygote is gone")
                return pids.pop(0)

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s exit code once the zygote reaped it, waiting up to ``timeout``."""
        exits = self._ledger.exits
        with self._cond:
            self._cond.wait_for(lambda: pid in exits or self._gone, timeout)
            if pid not in exits and self._gone:
                raise RuntimeError(f"the worker zygote died before worker {pid} ended")
            return exits.get(pid)

    def alive(self) -> bool:
        return not self._gone and self._proc.poll() is None


class _Forked(subprocess.Popen[bytes]):
    """A Popen for a worker the zygote forked (the zygote, not us, is its parent)."""

    def __init__(
        self,
        zygote: _Zygote,
        args: list[str],
        pid: int,
        pipes: tuple[Any, Any, Any],
    ) -> None:
        self._zygote = zygote
        self.args = args
        self.pid = pid
        self.stdin, self.stdout, self.stderr = pipes
        self.returncode = None
        self.text_mode = False
        self.encoding = self.errors = None
        self.pipesize = -1
        self._input = None
        self._communication_started = False
        self._waitpid_lock = threading.Lock()
        self._sigint_wait_secs = 0.25
        self._closed_child_pipe_fds = True
        self._child_created = False  # nothing for Popen.__del__ to reap

    def _internal_poll(self, _deadstate: int | None = None, **_: Any) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, 0)
        return self.returncode

    def _wait(self, timeout: float | None) -> int:
        if self.returncode is None:
            code = self._zygote.exit_code(self.pid, timeout)
            if code is None:
                assert timeout is not None
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = code
        return self.returncode


_ZYGOTE: _Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


def _zygote() -> _Zygote | None:
    global _ZYGOTE
    if os.environ.get("RELAYD_TEST_NO_ZYGOTE"):
        return None
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None or not _ZYGOTE.alive():
            _ZYGOTE = _Zygote()
        return _ZYGOTE


def popen(
    module: str, args: Sequence[str], *, cwd: str, stderr: bool = True
) -> subprocess.Popen[bytes]:
    """``python -m module args`` with pipes for stdin, stdout and (unless ``stderr``
    is False: /dev/null) stderr, forked from the zygote."""
    zygote = _zygote()
    argv = [sys.executable, "-m", module, *args]
    err = subprocess.PIPE if stderr else subprocess.DEVNULL
    if zygote is None:
        return subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, cwd=cwd
        )
    (in_r, in_w), (out_r, out_w) = os.pipe(), os.pipe()
    err_r, err_w = os.pipe() if stderr else (-1, os.open(os.devnull, os.O_WRONLY))
    try:
        pid = zygote.fork([module, *args], [in_r, out_w, err_w], cwd)
    except BaseException:
        for fd in (in_w, out_r, err_r):
            if fd >= 0:
                os.close(fd)
        raise
    finally:
        for fd in (in_r, out_w, err_w):
            os.close(fd)
    pipes = (
        os.fdopen(in_w, "wb"),
        os.fdopen(out_r, "rb"),
        os.fdopen(err_r, "rb") if stderr else None,
    )
    return _Forked(zygote, argv, pid, pipes)


def run(
    module: str, args: Sequence[str], *, cwd: str, input: bytes | None, timeout: float
) -> subprocess.CompletedProcess[bytes]:
    """:func:`subprocess.run` of ``python -m module args``, output captured."""
    with popen(module, args, cwd=cwd) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# --- the zygote ----------------------------------------------------------------------


def _serve(sock: socket.socket) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    sock.send(json.dumps({"ready": True}).encode())
    while True:
        for key, _ in sel.select():
            if key.fileobj is sock:
                data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 3)
                if not data:
                    return  # the test process is gone: its workers live on, as orphans
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    _child(sock, json.loads(data), fds)
                for fd in fds:
                    os.close(fd)
                sock.send(json.dumps({"pid": pid}).encode())
            else:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
        _reap(sock)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        sock.send(json.dumps({"exit": pid, "code": code}).encode())


def _child(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """The forked worker: never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        random.seed()
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
        sys.stdout = _text_out(1, unbuffered)
        sys.stderr = _text_out(2, True)
        module, *args = request["argv"]
        sys.argv = [module, *args]
        code = _run_main(module)
        threading._shutdown()  # type: ignore[attr-defined] # as the interpreter does at exit
        atexit._run_exitfuncs()
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code)


def _run_main(module: str) -> int:
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _text_out(fd: int, unbuffered: bool) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    if unbuffered:
        return io.TextIOWrapper(raw, write_through=True)
    return io.TextIOWrapper(io.BufferedWriter(raw))


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    for name in PRELOAD:
        __import__(name)
    _serve(sock)


if __name__ == "__main__":
    main()
