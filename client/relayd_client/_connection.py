"""A client's connection to its node's daemon: attach, re-attach, teardown.

:class:`Connection` owns what one session with the daemon consists of - the
gRPC channel, the attach answer, the mapped arena segments, the session
socket, the GPU side - and the client's lifecycle (``ClientState``). When the
daemon goes away it re-attaches in the background with bounded backoff, and
every public call of the client passes the one gate, :meth:`Connection.ready`:
usable now, or wait for the re-attach up to the call's own deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from . import _cuda, _cuda_facts, _fork
from ._grants import Grant, Grants, Lease, LeaseTable
from ._session import SessionChannel
from .wire import peercred
from .wire.errors import (
    DaemonUnavailableError,
    InvalidArgumentError,
    RelayError,
    SessionClosedError,
)
from .wire.framing import session_socket_path
from .wire.keepalive import KEEPALIVE_MS, KEEPALIVE_TIMEOUT_MS
from .wire.paths import default_socket_path
from .wire.proto import relay_pb2 as pb
from .wire.proto import relay_pb2_grpc as pb_grpc
from .wire.shm import PROBE_BYTES, SHM_POOL, MappedSegment
from .wire.status import from_rpc_error, unanswered
from .wire.version import PROTOCOL_VERSION

log = logging.getLogger(__name__)

# Re-attach after the daemon went away: retries back off from the first delay
# to the last and keep going while the client is open; each call waits for
# the re-attach only up to its own deadline.
RECONNECT_FIRST_DELAY = 0.05
RECONNECT_MAX_DELAY = 2.0
RECONNECT_CALLER_DELAY = 0.1  # between attempts while a call waits for one
# How long a channel given up on (see Connection._renew_channel) waits for its
# calls before it cancels them: longer than any of them lasts, since each
# ends by its own deadline or by the keepalive.
RETIRED_CALLS_GRACE_S = 3600.0
# The socket fallback moves whole packed regions in one gRPC message.
_MAX_MESSAGE = 1 << 30


def channel_options() -> list[tuple[str, int]]:
    """The options of the channel to the daemon (read at each connect: tests shorten
    the keepalive; see :mod:`relayd_client.wire.keepalive`)."""
    return [
        ("grpc.max_send_message_length", _MAX_MESSAGE),
        ("grpc.max_receive_message_length", _MAX_MESSAGE),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # How long gRPC waits for any ping's answer: keepalive_timeout_ms alone
        # leaves a keepalive ping's at a minute (grpcio 1.85).
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # A waiting call sends nothing: by default the channel stops pinging after
        # two pings without data, and a daemon that froze later goes unnoticed.
        ("grpc.http2.max_pings_without_data", 0),
        # No pings between calls (the default, said here because the daemon's
        # ping policy relies on it): nothing waits on the channel then, and the
        # daemon takes pings on a connection without calls for abuse.
        ("grpc.keepalive_permit_without_calls", 0),
        # Subchannels of this channel only. gRPC shares them process-wide by
        # target, and the target (/proc/self/fd/N, see PinnedSocket) repeats:
        # a re-attach's channel took over the closed one's failed subchannel
        # and its Attach failed with that connect's error.
        ("grpc.use_local_subchannel_pool", 1),
    ]


class ClientState(enum.Enum):
    UNOPENED = "unopened"
    OPENED = "opened"
    CLOSED = "closed"


def check_timeout(value: object, *, positive: bool = False) -> None:
    """A call's timeout is None (the client's) or a finite number of seconds;
    the client's own (``positive``) is a number above zero.

    NaN and infinity would reach timers and futures as a deadline that never
    comes, or as an OverflowError from the blocking client's wait.
    """
    if value is None and not positive:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or (positive and value <= 0)
    ):
        kind = "a positive finite" if positive else "a finite"
        raise InvalidArgumentError(f"timeout must be {kind} number of seconds, not {value!r}")


def default_socket() -> str:
    """``$RELAYD_SOCKET``, else where ``relayd serve`` listens on its embedded default."""
    return os.environ.get("RELAYD_SOCKET") or default_socket_path()


class Connection:
    """One client's session with the daemon, re-attached whenever the daemon comes back.

    ``on_frame`` handles the daemon's session frames; ``on_reset`` runs after
    a re-attach dropped the old session (grants and leases died with it).
    """

    def __init__(
        self,
        stages: Sequence[str],
        socket: str,
        timeout: float,
        daemon_uid: int | None,
        table: LeaseTable,
        on_frame: Callable[[pb.SessionFrame], None],
        on_reset: Callable[[], None],
    ) -> None:
        self.stages = tuple(stages)
        self.socket = socket
        self.timeout = timeout
        # Only a daemon running as one of these uids is sent anything (see wire/peercred.py).
        self._daemon_uid = daemon_uid
        self._trusted = peercred.trusted_uids(socket, daemon_uid)  # a bad uid fails here
        self._pinned: peercred.PinnedSocket | None = None
        self.state = ClientState.UNOPENED
        self._channel: grpc.aio.Channel | None = None
        self.stub: pb_grpc.RelayStub | None = None
        self._retired: set[asyncio.Task[None]] = set()  # channels closing (see _renew_channel)
        self.lock: threading.RLock = table.lock
        self._on_frame = on_frame
        self._on_reset = on_reset
        self.session = SessionChannel(on_frame, self._on_lost, self.lock)
        self.grants = Grants(table, self, self.require_open)
        self.attach: pb.AttachResponse | None = None
        self.segments: list[MappedSegment] = []
        self.views: list[Any] = []
        self.gpu: _cuda.GpuSide | None = None
        self._opened_in = _fork.forks
        self._opened_pid = os.getpid()
        self.draining = False
        self.lost = False
        # True when this process cannot map the arena: bytes go over gRPC.
        self.socket_fallback = False
        # Ask for the session's announcement socket (the blocking client: see _apart).
        self.announcements = False
        self._reconnect_task: asyncio.Task[None] | None = None
        self._reconnect_now = asyncio.Event()  # a call came: try again at once
        self._reattach_waiters = 0  # calls waiting for the re-attach

    # -- facts ----------------------------------------------------------------------

    @property
    def node_id(self) -> str:
        return self.attach.node_id if self.attach else ""

    @property
    def daemon_epoch(self) -> str:
        return self.attach.daemon_epoch if self.attach else ""

    @property
    def session_id(self) -> str:
        return self.attach.session_id if self.attach else ""

    # -- the gate every call passes -------------------------------------------------

    @property
    def forked(self) -> bool:
        """This process is a fork of the one that opened the session."""
        return self._opened_in != _fork.forks

    def require_open(self) -> pb.AttachResponse:
        """The attach answer of a usable session; raises when there is none right now."""
        if self.forked and self.state is not ClientState.UNOPENED:
            raise _fork.refused(self._opened_pid)
        if self.state is not ClientState.OPENED or self.attach is None:
            raise SessionClosedError(
                f"the client is {self.state.value}; use it inside `async with RelayClient(...)` "
                "or `with SyncRelayClient(...)` (or call open())"
            )
        if self.lost:
            raise DaemonUnavailableError(
                "the relayd daemon went away; re-attaching in the background"
            )
        return self.attach

    def usable(self) -> pb.AttachResponse | None:
        """The attach answer when no re-attach is pending: the gate without a coroutine.

        Callers write ``conn.usable() or await conn.ready(timeout)``; an await
        that never suspends still costs about half a microsecond per put.
        """
        return None if self.lost and not self.forked else self.require_open()

    async def ready(self, timeout: float | None) -> pb.AttachResponse:
        """Wait, up to the call's deadline, for a re-attach in progress; then as usable()."""
        if self.lost and self.state is ClientState.OPENED:
            if self._reconnect_task is None or self._reconnect_task.done():
                self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect())
            self._reconnect_now.set()
            self._reattach_waiters += 1
            limit = self.timeout if timeout is None else timeout
            task = self._reconnect_task
            try:
                # Not wait_for(shield(task)): a close() cancels the re-attach,
                # and that must reach this call as a closed client's error
                # (below), not as a CancelledError of its own.
                done, _ = await asyncio.wait((task,), timeout=max(limit, 0.0))
            finally:
                self._reattach_waiters -= 1
            if not done:
                raise DaemonUnavailableError(
                    f"the relayd daemon went away and did not come back within {limit:.3g}s"
                )
            if not task.cancelled() and (exc := task.exception()) is not None:
                raise exc
        return self.require_open()

    # -- lifecycle ------------------------------------------------------------------

    async def open(self) -> None:
        if self.state is ClientState.OPENED:
            return
        if self.state is ClientState.CLOSED:
            raise SessionClosedError("a closed RelayClient cannot be reopened; make a new one")
        self._opened_in, self._opened_pid = _fork.opening(), os.getpid()
        await self._connect()
        self.state = ClientState.OPENED

    async def close(self) -> None:
        """Stop re-attaching and end the session (the state is CLOSED already)."""
        if self.forked:
            self.forget()
            return
        if self._reconnect_task is not None:
            self._reconnect_task.cancel()
            with contextlib.suppress(BaseException):
                await self._reconnect_task
        await self._teardown()

    def forget(self) -> None:
        """A forked child's close: drop the parent's session without touching it.

        Its socket, gRPC channel and loop are the parent's too (a close or an
        unregistered descriptor here would reach them); the memory goes with
        this process.
        """
        self.state = ClientState.CLOSED
        self.attach = None
        self._reconnect_task = None

    async def _connect(self) -> None:
        """Attach, map the arena, bind the session socket; undo everything on failure."""
        # Again at every (re)connect: the socket's directory may appear after the client.
        self._trusted = peercred.trusted_uids(self.socket, self._daemon_uid)
        self._pinned = peercred.PinnedSocket(self.socket, self._trusted, self.timeout)
        stub = self._open_channel(self._pinned)
        try:
            self.attach = a = await stub.Attach(
                pb.AttachRequest(
                    protocol_version=PROTOCOL_VERSION,
                    stages=list(self.stages),
                    pid=os.getpid(),
                    namespaces=_namespaces(),
                    gpu_uuids=list(_cuda_facts.used_gpus()),
                ),
                timeout=self.timeout,
            )
            self.grants.configure(a.slot_size, a.default_grant_bytes)
            self.session.reserve_publishes = a.reserve_publishes
            self.session.reserve_over_read = a.reserve_over_read
            nonce = self._map_segments(a)
            await self.session.connect(
                session_socket_path(self.socket),
                a.session_id,
                a.session_token,
                self.timeout,
                shm_nonce=nonce,
                trusted=self._trusted,
                rings=bool(nonce),
                announcements=self.announcements,
            )
        except grpc.RpcError as exc:
            await self._teardown()
            raise from_rpc_error(exc) from None
        except BaseException:
            await self._teardown()
            raise
        if self.socket_fallback:
            self._unmap()
        else:
            self.grants.ring = self.session.freed_ring
        if not self.socket_fallback and self.views:
            self.gpu = _cuda.GpuSide(a, self.views)

    def _map_segments(self, a: pb.AttachResponse) -> bytes:
        """Map the arena; returns the probe nonce read from it (empty if it cannot be mapped).

        A process in another IPC/mount namespace (a container without the
        host's /dev/shm) cannot open the segments, or opens a same-named file
        that is not the daemon's: the daemon compares the nonce and answers
        with the session's data path in the BOUND event.
        """
        import torch

        try:
            for seg in sorted(a.segments, key=lambda s: s.index):
                mapped = MappedSegment(seg.name, seg.size, seg.index, a.slot_size)
                self.segments.append(mapped)
                # Through a memoryview: torch.frombuffer keeps its argument
                # alive but holds no buffer export, so a bare mmap could be
                # unmapped (and its addresses reused by the next arena) under
                # the tensors still viewing it. The memoryview's export makes
                # MappedSegment.close leave a viewed mapping to the last view.
                self.views.append(torch.frombuffer(memoryview(mapped.mm), dtype=torch.uint8))
            if not self.segments:
                return b""
            probe = a.probe_offset
            return bytes(self.segments[0].mm[probe : probe + PROBE_BYTES])
        except (OSError, ValueError) as exc:
            log.warning("cannot map the relayd arena (%s); moving bytes over the socket", exc)
            self._unmap()
            return b""

    def _unmap(self) -> None:
        if self.gpu is not None:
            self.gpu.close()  # unpins the arena: before the views go
            self.gpu = None
        # Under the lock: a put or get on a caller's thread checks `attached`
        # and takes its segment and view in one hold of it (see arena()).
        with self.lock:
            self.views.clear()
            for seg in self.segments:
                seg.close()
            self.segments.clear()

    def attached(self, a: pb.AttachResponse) -> bool:
        """Whether ``a`` is the session attached now, its arena mapped; under :attr:`lock`.

        A re-attach sets ``lost`` before it unmaps the old arena and clears it
        only once the new one is mapped, so a call that began under another
        attach (or while the daemon is away) must touch neither arena.
        """
        return not self.lost and self.attach is a

    def arena(self, lease: Lease) -> tuple[MappedSegment, Any]:
        """The segment and view of the arena ``lease`` was cut from; under :attr:`lock`.

        A lease still in the table belongs to the session attached now: a
        re-attach clears the table before it maps the new arena. The view,
        held by the caller, keeps the mapping alive through its copy.
        """
        if self.lost or self.grants.table.leases.get(lease.id) is not lease:
            raise DaemonUnavailableError(
                "relayd went away during the put; its lease went with it and nothing was published"
            )
        return self.segments[lease.grant.segment], self.views[lease.grant.segment]

    async def _teardown(self) -> None:
        self.grants.ring = None  # the session closes it
        await self.grants.cancel_calls()
        if self.gpu is not None:
            # GPU grants go back with the session: no copy may still be queued into them.
            await self.gpu.settle(self.timeout)
        await self.session.close()
        channel, self._channel = self._channel, None  # no renewal from here on
        if channel is not None:
            await channel.close()
        if self._retired:  # calls still on a renewed channel end within their own deadlines
            await asyncio.wait(set(self._retired), timeout=self.timeout)
        if self._pinned is not None:
            self._pinned.close()
            self._pinned = None
        self._unmap()

    # -- re-attach after the daemon went away ---------------------------------------

    def _on_lost(self) -> None:
        if self.state is ClientState.OPENED:
            log.warning("relayd session lost (daemon stopped or restarted)")
        self.lost = True
        self.grants.space.set()  # a put waiting for space fails at once
        if self.state is ClientState.OPENED and (
            self._reconnect_task is None or self._reconnect_task.done()
        ):
            self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        """Re-attach with bounded backoff until it works or the client is closed.

        Everything of the old session is dropped: its grants and leases died with
        the daemon, and DataRefs of the old epoch now fail with StaleEpochError.
        """
        delay = RECONNECT_FIRST_DELAY
        while self.state is ClientState.OPENED:
            self._reconnect_now.clear()  # a call from now on cuts the next wait short
            # A put may be waiting on the grant call: let it fail by itself once
            # the channel is closed (a cancel would reach that put as
            # CancelledError), and only then forget the old grants.
            pending = self.grants.detach(SHM_POOL)
            await self._teardown()
            if pending is not None:
                with contextlib.suppress(BaseException):
                    await pending.task
            with self.lock:  # a put sealing on a caller's thread sees all of it or none
                self.grants.table.clear()
                self._on_reset()
                self.session = SessionChannel(self._on_frame, self._on_lost, self.lock)
            try:
                await self._connect()
            except (RelayError, OSError, ValueError) as exc:
                # Backoff between attempts while nobody needs the daemon; a call
                # that does cuts it short and keeps attempts frequent until
                # it has its answer, so the first call after a restart does
                # not wait out a backoff grown while the daemon was gone.
                wait = RECONNECT_CALLER_DELAY if self._reattach_waiters else delay
                log.debug("re-attach failed (%s); retrying in %.2fs", exc, wait)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._reconnect_now.wait(), wait)
                delay = min(delay * 2, RECONNECT_MAX_DELAY)
                continue
            self.lost = False
            self.draining = False
            log.info("re-attached to relayd (epoch %s)", self.daemon_epoch)
            return

    async def call(self, method: str, request: Any, timeout: float) -> Any:
        """One gRPC call of this session: its id and token filled in, errors mapped."""
        a = self.require_open()
        stub = self.stub
        assert stub is not None
        request.session_id = a.session_id
        request.session_token = a.session_token
        try:
            return await getattr(stub, method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            if unanswered(exc):
                self._renew_channel(stub)
            raise from_rpc_error(exc) from None

    def _open_channel(self, pinned: peercred.PinnedSocket) -> pb_grpc.RelayStub:
        self._channel = grpc.aio.insecure_channel(
            f"unix:{pinned.address}", options=channel_options()
        )
        self.stub = stub = pb_grpc.RelayStub(self._channel)
        return stub

    def _renew_channel(self, failed: pb_grpc.RelayStub) -> None:
        """A call through ``failed`` got no answer: later calls go on a new channel.

        When the keepalive finds a frozen daemon, gRPC closes the connection
        only once its pending write is done, which is when the daemon runs
        again, and until then calls the connection READY and hands it the next
        call, which fails at once. A new channel makes a new connection (its
        subchannels are its own, see channel_options). The old one closes once
        the calls still on it have ended by themselves: closing it now would
        raise CancelledError in their callers.
        """
        old, pinned = self._channel, self._pinned
        if self.stub is not failed or old is None or pinned is None:
            return  # renewed already, or torn down
        self._open_channel(pinned)
        task = asyncio.get_running_loop().create_task(old.close(RETIRED_CALLS_GRACE_S))
        self._retired.add(task)
        task.add_done_callback(self._retired.discard)

    # -- what the grant wait asks of the session (see _grants.GrantSource) ----------

    async def request_grant(self, min_bytes: int, timeout: float, pool: str) -> Grant:
        resp: pb.GrantResponse = await self.call(
            "Grant",
            pb.GrantRequest(min_bytes=min_bytes, timeout_seconds=timeout, pool=pool),
            timeout + 1.0,
        )
        if resp.pool not in ("", SHM_POOL):
            if self.gpu is None or not self.gpu.fits(resp.pool, resp.slot, resp.nslots):
                raise RelayError(f"daemon granted a run outside GPU pool {resp.pool!r}")
        elif (
            resp.segment >= len(self.segments)
            or resp.slot + resp.nslots > self.segments[resp.segment].nslots
        ):
            raise RelayError("daemon granted a run outside its arena")
        return Grant(
            resp.grant_id, resp.segment, resp.slot, resp.nslots, resp.generation_base, resp.pool
        )

    def return_grant(self, grant_id: int) -> None:
        with self.lock:
            self.session.pending.return_grant.add(grant_id=grant_id)
            self.session.mark()

    def flush(self) -> None:
        self.session.flush()

    def free_lease(self, lease: Lease) -> None:
        """Give a lease's slots back to its grant (a GPU lease once its copy is done)."""
        if self.gpu is not None and lease.grant.pool != SHM_POOL:
            # Not before the writer's copy into these slots is complete.
            self.gpu.free_slots(lease.id, functools.partial(self.grants.slots_back, lease))
            return
        self.grants.slots_back(lease)

    def rpc_timeout(self, timeout: float | None) -> float:
        """A call's timeout: the caller's, checked, else the client's."""
        if timeout is None:
            return self.timeout
        check_timeout(timeout)
        return timeout


def _namespaces() -> dict[str, str]:
    out = {}
    for ns in ("pid", "ipc", "mnt"):
        with contextlib.suppress(OSError):
            out[ns] = os.readlink(f"/proc/self/ns/{ns}")
    return out
