"""The Mooncake engine's own calls, for :mod:`relayd.transports.mooncake`.

The one table that turns Mooncake's return codes into RelayErrors, loading
the native module (with the fix for each missing library), and the blocking
calls that run on the transport's worker threads: open an engine, submit a
pull's batches and watch them, check their states, tear the engine down. The
module docstring of :mod:`relayd.transports.mooncake` says why they are
shaped this way (one batch per op, a watch on the worker thread).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import enum
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from relayd_client.wire.errors import (
    InternalError,
    InvalidArgumentError,
    PeerUnavailableError,
    RelayError,
)

from relayd.transports._native_log import native_stderr_to_log
from relayd.transports.base import (
    MemoryRegion,
    PullOp,
    TransferState,
    TransportUnavailableError,
)

logger = logging.getLogger(__name__)

PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
"""What to install on CPU-only hosts (and GPU hosts that only move host memory)."""

# The watcher's sleep between checks of the batches in flight: a quarter of how long
# the oldest has run, within these bounds, so a transfer is seen to end at most 25%
# (or the floor) after it did, and a long one costs few wake-ups. Each check costs
# the GIL and a wake-up on a core the transfer itself needs.
WATCH_FLOOR = 50e-6
WATCH_CAP = 1e-3
# Linux lets a sleeping thread's timer fire up to its "slack" late, 50 us by default:
# more than the floor itself. The watcher asks for this much instead.
WATCH_TIMER_SLACK_NS = 1000
_PR_SET_TIMERSLACK = 29

# Mooncake reads its settings from the process environment, so they are set just
# before the engine is constructed; the lock keeps two engines in one process from
# seeing each other's values half-written.
ENV_LOCK = threading.Lock()


# --- Mooncake return codes -> RelayErrors: this table and nowhere else -------------


class Call(enum.Enum):
    INITIALIZE = "initialize"
    REGISTER = "register_memory"
    SUBMIT = "batch_transfer_async_read"
    STATUS = "transfer_check_status"


_RC_MEANING: dict[int, str] = {
    0: "no batch id",
    -1: "failed; the reason is in Mooncake's log on stderr",
    -3: "address not registered",
    -7: "range overlaps a registered one",
    -102: "peer did not answer",
    -200: "metadata server unreachable",
}
_ERROR_FOR_CALL: dict[Call, type[RelayError]] = {
    Call.INITIALIZE: TransportUnavailableError,
    Call.REGISTER: InternalError,
    Call.SUBMIT: PeerUnavailableError,
    Call.STATUS: InternalError,
}
_ERROR_FOR_RC: dict[tuple[Call, int], type[RelayError]] = {
    (Call.REGISTER, -7): InvalidArgumentError,
    # A transfer that ended FAILED: the peer is gone, refused us (e.g. the remote
    # range is not registered there) or stopped answering for MC_TCP_STATUS_TIMEOUT_SEC.
    (Call.STATUS, -1): PeerUnavailableError,
}
_STATE_FOR_STATUS: dict[int, TransferState] = {
    1: TransferState.DONE,
    0: TransferState.PENDING,
    -1: TransferState.FAILED,
    -2: TransferState.TIMEOUT,
}


def mooncake_error(call: Call, rc: int, context: str) -> RelayError:
    """The RelayError for Mooncake call ``call`` returning ``rc``."""
    cls = _ERROR_FOR_RC.get((call, rc), _ERROR_FOR_CALL[call])
    meaning = _RC_MEANING.get(rc, "unknown return code")
    return cls(f"mooncake {call.value} {context}: returned {rc} ({meaning})")


def transfer_state(rc: int) -> TransferState:
    """``transfer_check_status``'s integer as a TransferState."""
    state = _STATE_FOR_STATUS.get(rc)
    if state is None:
        raise mooncake_error(Call.STATUS, rc, "of a submitted op")
    return state


def submit_failed(batch_id: int) -> bool:
    # 0 on failure (measured); the C++ source can also return -1 cast to uint64.
    return batch_id <= 0 or batch_id >= 1 << 63


_LIBRARY_FIXES = (
    ("libibverbs.so", "apt-get install libibverbs1"),
    ("libnuma.so", "apt-get install libnuma1"),
    ("libcurl.so", "apt-get install libcurl4 (libcurl4t64 on Debian 13 / Ubuntu 24.04)"),
    ("libcudart.so", f"the CUDA wheel needs the CUDA 12 runtime; without it install {PACKAGE}"),
    ("libcuda.so", f"the CUDA wheel needs the NVIDIA driver; without it install {PACKAGE}"),
)


def import_engine_module() -> Any:
    """``mooncake.engine``, or TransportUnavailableError saying what to install."""
    try:
        return importlib.import_module("mooncake.engine")
    except ImportError as exc:
        text = str(exc)
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").startswith("mooncake"):
            message = f"Mooncake Transfer Engine is not installed: pip install '{PACKAGE}'"
        else:
            fix = next((f for lib, f in _LIBRARY_FIXES if lib in text), f"reinstall {PACKAGE}")
            message = f"cannot load Mooncake Transfer Engine ({text}); fix: {fix}"
        raise TransportUnavailableError(message) from exc


def open_engine(host: str, env: Mapping[str, str | None], protocol: str, device: str) -> Any:
    """Worker thread: import, configure and initialise an engine; returns (engine, port)."""
    with ENV_LOCK, native_stderr_to_log():
        module = import_engine_module()
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        engine = module.TransferEngine()
        rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device)
    if rc != 0:
        raise mooncake_error(Call.INITIALIZE, rc, f"as {host} over {protocol}")
    return engine, int(engine.get_rpc_port())


def submit_blocking(
    engine: Any,
    peer: str,
    phases: tuple[tuple[PullOp, ...], ...],
    write: bool = False,
) -> tuple[list[int], list[TransferState], RelayError | None]:
    """Submit the first of ``phases``, one batch per op (see the module docstring of
    :mod:`relayd.transports.mooncake`): a READ to a peer already reached on the
    event loop (it then only queues), anything else on a worker thread. Returns
    the ids and states of the ops it submitted."""
    ids: list[int] = []
    states: list[TransferState] = []
    failure: RelayError | None = None
    submit = engine.batch_transfer_async_write if write else engine.batch_transfer_async_read
    for op in phases[0] if phases else ():
        if failure is not None:  # the pull has failed; don't put more bytes in flight
            ids.append(0)
            states.append(TransferState.FAILED)
            continue
        batch_id = int(submit(peer, [op.local_addr], [op.remote_addr], [op.length]))
        if submit_failed(batch_id):
            failure = mooncake_error(Call.SUBMIT, 0, f"to {peer}")
            ids.append(0)
            states.append(TransferState.FAILED)
        else:
            ids.append(batch_id)
            states.append(TransferState.PENDING)
    return ids, states, failure


def check(engine: Any, ids: list[int], states: list[TransferState], start: int = 0) -> bool:
    """Ask once for every op from ``start`` not yet terminal (a terminal one's batch
    is freed: it is never asked again); True when all of them are terminal."""
    for i in range(start, len(states)):
        if not states[i].terminal:
            states[i] = transfer_state(engine.transfer_check_status(ids[i]))
    return all(s.terminal for s in states[start:])


class Watcher:
    """One thread that watches every batch in flight and reports each finished
    transfer to the event loop.

    It sleeps on an event while nothing is in flight (no CPU when idle) and is
    woken by the next submission; while something is, it checks every batch,
    then sleeps a little (see ``WATCH_FLOOR``). Each transfer's ids and states
    are its own from :meth:`watch` on: nothing else calls
    ``transfer_check_status`` on them, which frees a batch once terminal.
    """

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self._loop = loop
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        # (ids, states, the first op to watch, when it was handed over, what to call
        # on the loop once that op and every one after it are terminal)
        self._jobs: list[tuple[list[int], list[TransferState], int, float, Callable[[], None]]] = []
        self._thread = threading.Thread(target=self._run, name="relayd-mooncake-watch", daemon=True)
        self._thread.start()

    def watch(
        self, ids: list[int], states: list[TransferState], start: int, done: Callable[[], None]
    ) -> None:
        """Until the ops of ``states`` from ``start`` on are terminal, then ``done()``
        on the loop. Until then nobody else may touch ``states[start:]``."""
        with self._lock:
            self._jobs.append((ids, states, start, time.perf_counter(), done))
        self._wake.set()

    def stop(self) -> None:
        """No more checks once this returns (any thread but the watcher's own); the
        engine is no longer referenced here, so whoever drops it last destroys it."""
        with self._lock:
            self._stopped = True
        self._wake.set()
        self._thread.join()
        self._engine = None

    def _run(self) -> None:
        _lower_timer_slack()
        while True:
            with self._lock:
                if self._stopped:
                    return
                # Cleared before the snapshot: a job added after it sets it again.
                self._wake.clear()
                jobs = list(self._jobs)
            if not jobs:
                self._wake.wait()
                continue
            finished: list[Callable[[], None]] = []
            now = time.perf_counter()
            oldest = now
            for job in jobs:
                ids, states, start, since, done = job
                try:
                    terminal = check(self._engine, ids, states, start)
                except RelayError:  # an unknown status code: that transfer failed
                    for i in range(start, len(states)):
                        if not states[i].terminal:
                            states[i] = TransferState.FAILED
                    terminal = True
                if terminal:
                    finished.append(done)
                    with self._lock:
                        self._jobs.remove(job)
                else:
                    oldest = min(oldest, since)
            if finished:
                with contextlib.suppress(RuntimeError):  # the loop is gone
                    self._loop.call_soon_threadsafe(_call_all, finished)
            if len(finished) < len(jobs):
                # A new submission cuts the pause short.
                self._wake.wait(min(max((now - oldest) / 4, WATCH_FLOOR), WATCH_CAP))


def _call_all(fns: list[Callable[[], None]]) -> None:
    for fn in fns:
        fn()


def _lower_timer_slack() -> None:
    """This thread's timers fire within ``WATCH_TIMER_SLACK_NS`` (Linux; else a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_TIMERSLACK, WATCH_TIMER_SLACK_NS, 0, 0, 0)


def teardown_engine(
    engine: Any,
    pool: concurrent.futures.ThreadPoolExecutor | None,
    regions: list[MemoryRegion],
    watcher: Watcher | None = None,
) -> None:
    """Teardown thread: wait for the workers and the watcher, then unregister and
    drop the engine."""
    if pool is not None:
        pool.shutdown(wait=True)
    if watcher is not None:
        watcher.stop()
    with native_stderr_to_log():
        for region in regions:
            rc = engine.unregister_memory(region.base)
            if rc != 0:
                logger.warning("mooncake unregister_memory(%s) returned %d", region.name, rc)
        del engine  # the last reference: the engine stops its threads here (0.3-1 s)
