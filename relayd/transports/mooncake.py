"""Cross-node pulls through Mooncake Transfer Engine (TE).

One engine per daemon, in P2PHANDSHAKE mode: no metadata server, the session id
is ``"<host>:<rpc port>"`` and peers learn it from the DataRef / Peer handshake.
Importing this module does not import Mooncake; ``start()`` does.

What Mooncake does and does not guarantee (package 0.3.13.post1, measured):

* Every failure is a bare ``-1`` (a few calls have -3/-7/-102/-200); the reason
  is only in its glog output on stderr. :func:`mooncake_error` is the one place
  those integers become RelayErrors.
* A submitted transfer cannot be cancelled. It ends DONE or FAILED; on a hung
  peer the TCP transport fails it after ``MC_TCP_STATUS_TIMEOUT_SEC`` (set from
  ``peer_timeout``). Until then bytes may land in local memory, hence the
  in-flight rule of :mod:`relayd.transports.base`: a pull returns only after
  every op is terminal, or raises with ``in_flight=True`` and a ``settled``
  future.
* ``transfer_check_status`` reports only the *first* task of a batch, and frees
  the batch on DONE/FAILED (polling a freed id is undefined behaviour). A 1 B +
  64 MiB batch read "done" after 0.3-2 ms with the 64 MiB still landing. So each
  op is its own batch, polled until terminal and never again.
* The sync calls (``transfer_sync_read``, ``batch_transfer_sync_*``,
  ``get_batch_transfer_status``) busy-spin a core for up to
  ``MC_TRANSFER_TIMEOUT`` (floor 5 s) and, on their own timeout, give up on
  slices that are still in flight. They are not used for data.
* The engine listens on all interfaces, without authentication, and serves any
  registered memory to whoever connects: register only relay buffers and
  firewall the RPC port range (``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT``,
  default 15000-17000) to cluster peers.
* First contact with a peer that accepts TCP but never answers costs a
  hard-coded 60 s handshake inside the submit call; it runs on a worker thread,
  and only one submit per not-yet-reached peer runs at a time, so such a peer
  can tie up one worker, not all of them.

Threads: every call that can block (import, ``initialize``, ``register_memory``,
the first submit to a peer not reached yet, engine teardown) runs on a small named
ThreadPoolExecutor. A READ submitted to a peer already reached only queues the
op, so it runs on the event loop; a WRITE submit does not always return at once
(measured, two processes, 30 async submits per size: READ median 5-29 us, max
53 us; WRITE median 7-35 us, max 3.4 ms at 256 KiB, 8.4 ms at 4 MiB), so pushes
submit from a worker. Completion is watched by one thread for all transfers
(:class:`relayd.transports.mooncake_engine.Watcher`), not one per transfer and
not the loop: the loop rounds every timer up to 1 ms (once the floor of a small
pull), the sync calls busy-spin a core (on a busy node, the core the peer needs
to serve the read). The watcher sleeps while nothing is in flight and is woken by
the next submit; while something is, it checks every quarter of the oldest one's
age (50 us to 1 ms), with a 1 us timer slack instead of Linux's default 50 us.
Measured in one process, 256 KiB Mooncake writes over loopback: sync call
41 us; async + 50 us sleeps 135 us, 91 us with the 1 us slack; CPU ~80 us per
write in every case.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import os
import pathlib
import threading
from collections.abc import Mapping
from typing import Any

from relayd_client.wire.errors import (
    InternalError,
    InvalidArgumentError,
    RelayError,
)

from relayd.config import Settings
from relayd.transports.base import (
    InFlight,
    MemoryRegion,
    PullFailedError,
    PullOp,
    PullTimeoutError,
    RemoteTransport,
    Transfer,
    TransferState,
    TransportState,
    TransportUnavailableError,
    follow,
)
from relayd.transports.mooncake_engine import (
    Call,
    Watcher,
    import_engine_module,
    mooncake_error,
    open_engine,
    submit_blocking,
    teardown_engine,
)

logger = logging.getLogger(__name__)

_INFINIBAND = pathlib.Path("/sys/class/infiniband")

# --- settings -> Mooncake's inputs ----------------------------------------------------


def mooncake_environment(settings: Settings, current: Mapping[str, str]) -> dict[str, str | None]:
    """The MC_* variables for ``settings``; None means "remove".

    ``current`` is the environment as it is, consulted only so an operator's own
    ``MC_LOG_LEVEL`` wins; everything else is derived from settings.
    """
    secs = max(1, math.ceil(settings.peer_timeout))
    env: dict[str, str | None] = {
        # Async transfers to a hung peer fail after this (default 30 s).
        "MC_TCP_STATUS_TIMEOUT_SEC": str(secs),
        # connect() to an unreachable handshake port (default 5 s, range 1-3599).
        # The handshake *receive* timeout is a hard-coded 60 s with no knob.
        "MC_HANDSHAKE_CONNECT_TIMEOUT": str(min(secs, 3599)),
        # Only the sync wrappers use it (not relayd); read at construction, floor 5.
        "MC_TRANSFER_TIMEOUT": str(max(5, secs)),
    }
    if settings.mooncake_protocol == "tcp":
        # The protocol argument does not pick the transport: Mooncake auto-selects
        # RDMA whenever an HCA is present. Forcing TCP keeps the choice ours.
        env["MC_FORCE_TCP"] = "1"
        env["MC_FORCE_HCA"] = None
    else:
        env["MC_FORCE_TCP"] = None
        env["MC_FORCE_HCA"] = "1"
    if "MC_LOG_LEVEL" not in current:
        # INFO logs every new peer; keep stderr for warnings unless debugging.
        env["MC_LOG_LEVEL"] = "INFO" if settings.log_level == "debug" else "WARNING"
    return env


def advertised_host(peer_address: str) -> str:
    """The host part of ``peer_address`` (what peers will dial), or 127.0.0.1."""
    text = peer_address.strip()
    if not text:
        return "127.0.0.1"
    if text.startswith("["):
        host = text[1 : text.find("]")] if "]" in text else ""
    elif text.count(":") == 1:
        host = text.rsplit(":", 1)[0]
    else:
        host = text  # a bare IPv6 address or host name
    if host in ("", "0.0.0.0", "::", "*"):
        raise InvalidArgumentError(
            f"peer_address {peer_address!r} has no routable host; Mooncake advertises it "
            "to peers, so give this node's address (e.g. 10.0.0.5:7070)"
        )
    return host


def _session_id(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --- preflight ------------------------------------------------------------------------


def rdma_problem(settings: Settings, *, infiniband: pathlib.Path = _INFINIBAND) -> str | None:
    """Why ``mooncake_protocol = "rdma"`` cannot work here, or None (also None for tcp)."""
    if settings.mooncake_protocol != "rdma":
        return None
    try:
        devices = sorted(p.name for p in infiniband.iterdir())
    except OSError:
        devices = []
    if not devices:
        return (
            f"mooncake_protocol is rdma but this host has no RDMA device ({infiniband} "
            "is empty or missing); install the NIC driver and ibverbs-providers, or use tcp"
        )
    wanted = [d.strip() for d in settings.mooncake_device.split(",") if d.strip()]
    missing = [d for d in wanted if d not in devices]
    if missing:
        return f"mooncake_device lists {missing}, not present on this host (found {devices})"
    return None


def preflight(settings: Settings) -> str | None:
    """What stops Mooncake from working here, or None. Imports ``mooncake.engine``."""
    try:
        import_engine_module()
    except TransportUnavailableError as exc:
        return exc.message
    return rdma_problem(settings)


# --- the transport ------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Pull:
    """One pull() and the Mooncake batches it owns."""

    peer: str
    ops: tuple[PullOp, ...]
    deadline: float
    settled: asyncio.Future[None]
    """Internal; done once no op can write any more. Errors hand out copies."""
    submitting: bool = False
    """A submit job has started and not reported: what it handed Mooncake is unknown."""
    # Ops [0, first) go first; the rest only once all of those are DONE.
    first: int = 0
    # For the ops submitted so far (a prefix of ``ops``); the rest cannot write.
    batch_ids: list[int] = dataclasses.field(default_factory=list)
    states: list[TransferState] = dataclasses.field(default_factory=list)
    failure: RelayError | None = None
    task: asyncio.Task[None] | None = None
    write: bool = False
    """A push: the ops copy local ranges into the peer's (Mooncake WRITE)."""

    def quiet(self) -> bool:
        """Nothing of this pull can write any more, as long as nothing more is
        submitted. A submit job that has not reported (running, or it raised)
        leaves us unable to tell, so that counts as in flight."""
        return not self.submitting and all(s.terminal for s in self.states)

    def phases_left(self) -> tuple[tuple[PullOp, ...], ...]:
        """The ops not submitted yet, as the phases they still form."""
        done = len(self.states)
        if done < self.first:
            return tuple(p for p in (self.ops[done : self.first], self.ops[self.first :]) if p)
        return (self.ops[done:],) if done < len(self.ops) else ()


class MooncakeTransport(RemoteTransport):
    """Pull-based cross-node transfers through one Mooncake engine (P2PHANDSHAKE)."""

    def __init__(self, settings: Settings, *, workers: int = 8) -> None:
        super().__init__()
        self._settings = settings
        self._workers = workers
        self._engine: Any = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._unsettled: set[_Pull] = set()
        self._reached: set[str] = set()
        self._first_contact: dict[str, asyncio.Lock] = {}
        self._watcher: Watcher | None = None

    async def start(self) -> None:
        self._begin_start()
        problem = rdma_problem(self._settings)
        if problem:
            raise TransportUnavailableError(problem)
        host = advertised_host(self._settings.peer_address)
        env = mooncake_environment(self._settings, os.environ)
        pool = concurrent.futures.ThreadPoolExecutor(
            self._workers, thread_name_prefix="relayd-mooncake"
        )
        loop = asyncio.get_running_loop()
        try:
            self._engine, port = await loop.run_in_executor(
                pool,
                open_engine,
                host,
                env,
                self._settings.mooncake_protocol,
                self._settings.mooncake_device,
            )
        except BaseException:
            pool.shutdown(wait=False)
            raise
        self._pool = pool
        self._watcher = Watcher(self._engine, loop)
        self._session = _session_id(host, port)
        self._state = TransportState.OPEN
        logger.info(
            "mooncake engine up: session %s, protocol %s",
            self._session,
            self._settings.mooncake_protocol,
        )

    async def register(self, region: MemoryRegion) -> None:
        self._require_open()
        self._regions.check_new(region)
        loop = asyncio.get_running_loop()
        rc = await loop.run_in_executor(
            self._pool, self._engine.register_memory, region.base, region.length
        )
        if rc != 0:
            raise mooncake_error(
                Call.REGISTER, rc, f"of {region.name} ({region.length} B at {region.base:#x})"
            )
        self._regions.add(region)

    async def transfer(self, request: Transfer) -> None:
        # Mooncake acks a WRITE only once the peer applied it (TCP protocol v2), so
        # a push returns on the same terms as a pull.
        self._require_open()
        checked, after = self._regions.check(request.ops), self._regions.check(request.then)
        if not checked:
            checked, after = after, ()
        if not checked:
            return
        loop = asyncio.get_running_loop()
        peer_session, timeout = request.peer_session, request.timeout
        rec = _Pull(
            peer_session, checked + after, loop.time() + timeout, loop.create_future(),
            first=len(checked), write=request.write,
        )  # fmt: skip
        self._unsettled.add(rec)
        rec.task = loop.create_task(self._drive(rec), name=f"relayd-mooncake-pull {peer_session}")
        try:
            done, _ = await asyncio.wait((rec.task,), timeout=max(timeout, 0.0))
        except asyncio.CancelledError:
            self._abandon(rec)
            raise
        if done and not rec.task.cancelled():
            rec.task.result()
            return
        self._abandon(rec)
        in_flight = not rec.quiet()
        nbytes = sum(op.length for op in checked)
        what = f"{request.verb} of {nbytes} B in {len(checked)} op(s) with {peer_session}"
        suffix = "; still in flight" if in_flight else ""
        settled = follow(rec.settled)
        if done:  # close() cancelled the pull under us
            why = f"{what} stopped: the transport was closed{suffix}"
            raise request.error(PullFailedError, why, in_flight=in_flight, settled=settled)
        if rec.failure is not None or TransferState.FAILED in rec.states:
            why = f"{what} failed{suffix}"
            failed = request.error(PullFailedError, why, in_flight=in_flight, settled=settled)
            raise failed from rec.failure
        why = f"{what} did not finish within {timeout:g}s{suffix}"
        raise request.error(PullTimeoutError, why, in_flight=in_flight, settled=settled)

    def _in_flight(self) -> list[InFlight]:
        return [(rec.ops, rec.settled) for rec in self._unsettled]

    async def close(self) -> None:
        if self._state is not TransportState.OPEN:
            self._state = TransportState.CLOSED
            return
        self._state = TransportState.CLOSED
        tasks = [rec.task for rec in self._unsettled if rec.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # From here only worker threads touch the engine. A dedicated thread waits for
        # them (a submit can sit in a 60 s handshake), then unregisters and destroys
        # the engine, after which nothing can write into local memory: only then are
        # the remaining quarantines lifted.
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()
        # The teardown thread must hold the last reference to the engine.
        handoff = [self._engine]
        pool, regions, watcher = self._pool, self._regions.take_all(), self._watcher
        self._engine, self._pool, self._watcher = None, None, None

        def lift() -> None:
            for rec in list(self._unsettled):
                self._settle(rec)
            if not finished.done():
                finished.set_result(None)

        def teardown() -> None:
            try:
                teardown_engine(handoff.pop(), pool, regions, watcher)
            finally:
                # RuntimeError: the loop is gone, nobody is left to tell.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(lift)

        threading.Thread(target=teardown, name="relayd-mooncake-teardown", daemon=True).start()
        grace = self._settings.peer_timeout + 2.0
        await asyncio.wait((finished,), timeout=grace)
        if not finished.done():
            logger.warning(
                "mooncake engine still busy %.1fs after close; %d pull(s) stay quarantined "
                "until it stops",
                grace,
                len(self._unsettled),
            )

    # --- internals ---------------------------------------------------------------

    def _abandon(self, rec: _Pull) -> None:
        """The caller stopped waiting; a pull with nothing in flight stops, so that
        a later phase is never submitted into ranges the caller was told are free."""
        if rec.task is None:
            return
        if rec.quiet():
            rec.task.cancel()
        # Nobody awaits the task any more; its outcome is only the quarantine's.
        rec.task.add_done_callback(_consume)

    def _settle(self, rec: _Pull) -> None:
        self._unsettled.discard(rec)
        if not rec.settled.done():
            rec.settled.set_result(None)

    async def _drive(self, rec: _Pull) -> None:
        try:
            # The submit job goes on to the next phase itself when it saw the
            # one before land; otherwise the loop polls and submits it here.
            while True:
                start = len(rec.states)
                await self._submit(rec)
                await self._poll(rec, start)
                if rec.failure is not None or not rec.phases_left():
                    break
                if any(s is not TransferState.DONE for s in rec.states):
                    break  # a failed phase: the next one is never submitted
        except Exception as exc:
            # An unknown status code (or a bug): the pull has failed, and whatever
            # was not seen to end stays quarantined until close().
            logger.exception("mooncake pull from %s broke", rec.peer)
            rec.failure = exc if isinstance(exc, RelayError) else InternalError(repr(exc))
        finally:
            if rec.quiet():
                self._settle(rec)
        if rec.failure is not None or TransferState.FAILED in rec.states:
            failed = sum(s is TransferState.FAILED for s in rec.states)
            cause = rec.failure or mooncake_error(
                Call.STATUS, -1, f"for {failed} of {len(rec.ops)} op(s) from {rec.peer}"
            )
            raise PullFailedError(
                f"pull from {rec.peer} failed: {cause.message}",
                peer_session=rec.peer,
                in_flight=not rec.quiet(),
                settled=follow(rec.settled),
            ) from cause

    async def _submit(self, rec: _Pull) -> None:
        if rec.peer in self._reached:
            await self._submit_now(rec)
            return
        # First contact can block a worker in a handshake for up to 60 s: let one
        # submit per unreached peer through at a time.
        lock = self._first_contact.setdefault(rec.peer, asyncio.Lock())
        async with lock:
            await self._submit_now(rec)

    async def _submit_now(self, rec: _Pull) -> None:
        rec.submitting = True
        args = (self._engine, rec.peer, rec.phases_left(), rec.write)
        if rec.peer in self._reached and not rec.write:
            # A READ submitted to a peer already reached only queues the op: no
            # thread hop. A WRITE submit can block for milliseconds (see the
            # module docstring), so it goes through a worker like first contact.
            ids, states, failure = submit_blocking(*args)
        else:
            loop = asyncio.get_running_loop()
            ids, states, failure = await loop.run_in_executor(self._pool, submit_blocking, *args)
        rec.batch_ids += ids
        rec.states += states
        rec.submitting = False
        rec.failure = failure
        if failure is not None:
            # A failed submit may mean a connection to set up again, which can block:
            # the next submit to this peer goes through a worker first.
            self._reached.discard(rec.peer)
        elif any(ids):
            self._reached.add(rec.peer)
            self._first_contact.pop(rec.peer, None)

    async def _poll(self, rec: _Pull, start: int) -> None:
        """Until the ops submitted from ``start`` on are terminal (the watcher's word)."""
        if all(s.terminal for s in rec.states[start:]):
            return
        assert self._watcher is not None
        done = asyncio.get_running_loop().create_future()
        self._watcher.watch(rec.batch_ids, rec.states, start, lambda: _resolve(done))
        await done
        if TransferState.FAILED in rec.states[start:]:
            self._reached.discard(rec.peer)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _consume(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.debug("abandoned pull ended: %s", task.exception())
