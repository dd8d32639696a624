"""RelayClient: the thin client a stage process links.

A put packs the payload's tensors into one contiguous slot run - a lease cut
from a grant this session already holds - stamps the run's header with a
fresh generation, sends one batched notice and returns the DataRef. A get
checks that generation in shared memory, copies out (or hands out views)
and sends a release notice. Neither waits for a daemon round trip; gRPC is
used to attach, to get more grants (a few times per session) and to abort.

:class:`RelayClient` is the public surface over parts that each own one
thing: :mod:`_connection` (attach, re-attach, the gate every call passes),
:mod:`_grants` (leases and the grant wait), :mod:`_writer` and
:mod:`_reader` (the put and get paths), :mod:`_gpu_paths`, :mod:`_streams`,
:mod:`_keyed`, :mod:`_reports` and :mod:`_aborts`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from . import _copies, _flatten, _keyed, _local
from ._aborts import AbortedRequests
from ._checks import ReadChecks
from ._connection import ClientState, Connection, check_timeout, default_socket
from ._gpu_paths import GpuPaths
from ._grants import LeaseTable
from ._notices import Notices
from ._reader import Reader
from ._refs import TensorRef
from ._reports import Reports
from ._routes import Routes
from ._steady import PutLanes
from ._streams import Streams
from ._writer import (
    MAX_SIGNAL_MESSAGE,
    OFFLOAD_BYTES,
    Writer,
    check_names,
    check_trace_id,
    leased,
)
from .wire import latency
from .wire.dataref import KIND_DONE, KIND_ERROR, DataRef
from .wire.errors import InvalidArgumentError, RelayError, RelayTimeoutError
from .wire.names import check_key, check_request_id, check_stage
from .wire.proto import relay_pb2 as pb
from .wire.transport import Transport

log = logging.getLogger(__name__)


class RelayClient:
    """Async client of the node's relayd.

    ``stage`` names the stage(s) this process serves; a DataRef addressed to
    another stage is refused. Use as ``async with RelayClient(...) as c:``;
    a closed client cannot be reopened.

    ``cuda_ipc_direct=True`` lets same-GPU puts travel as PyTorch storage
    handles instead of through the daemon's GPU pool; the writer then keeps
    PyTorch's IPC contract (every ref read exactly once, tensors alive and
    unmodified, its process running until read; see ``_cuda``).
    """

    def __init__(
        self,
        stage: str | Sequence[str],
        socket: str | None = None,
        *,
        timeout: float = 10.0,
        allow_pickle: bool = False,
        daemon_uid: int | None = None,
        cuda_ipc_direct: bool = False,
    ) -> None:
        check_timeout(timeout, positive=True)
        self.stages = (stage,) if isinstance(stage, str) else tuple(stage)
        if not self.stages:
            raise InvalidArgumentError("stage must be a non-empty name or list of names")
        for name in self.stages:
            check_stage(name, "stage")
        self.socket = socket or default_socket()
        self.timeout = timeout
        self.allow_pickle = allow_pickle
        self.cuda_ipc_direct = cuda_ipc_direct
        self._table = LeaseTable()
        self._conn = conn = Connection(
            self.stages,
            self.socket,
            timeout,
            daemon_uid,
            self._table,
            self._on_frame,
            self._on_reset,
        )
        self._grants = conn.grants
        lock, stage0 = self._table.lock, self.stages[0]
        self._aborts = AbortedRequests()
        self._checks = ReadChecks(lock, allow_pickle)
        self._notices = Notices(conn, lock, stage0, self._checks)
        self._reports = Reports(conn, lock, stage0)
        self._routes = Routes(conn, stage0, cuda_ipc_direct)
        self._gpu_paths = GpuPaths(conn, self._checks, self._notices, self._aborts, self._reports)
        self._writer = Writer(conn, self._notices, self._aborts, self._reports, self._routes)
        self._reader = Reader(conn, self._checks, self._notices, self._aborts, self._gpu_paths)
        self._put_lanes = PutLanes(conn, self._writer, self._routes, self._aborts)
        self._streams = Streams(self._aborts, self.discard)
        self._loop: asyncio.AbstractEventLoop | None = None  # the one it was opened on

    # -- lifecycle ------------------------------------------------------------------

    async def __aenter__(self) -> RelayClient:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        if self._conn.state is ClientState.OPENED:
            return
        await self._conn.open()
        self._loop = asyncio.get_running_loop()
        _local.serve(self.stages, self, self._local_abort)

    async def close(self) -> None:
        conn = self._conn
        if conn.state is ClientState.CLOSED:
            return
        if conn.forked:  # nothing may reach the parent's session from here
            conn.forget()
            return
        await self._streams.settle(self.timeout)  # unread chunks' discards need the session
        conn.state = ClientState.CLOSED
        _local.unserve(self.stages, self)
        self._reports.flush()
        await conn.close()

    def _on_reset(self) -> None:
        """A re-attach dropped the old session: its zero-copy holds died with it, and
        the new daemon numbers its leases afresh (an old released id is a new lease)."""
        self._reader.held.clear()
        self._reader.announced.clear()
        self._checks.released.clear()

    # -- facts ----------------------------------------------------------------------

    @property
    def state(self) -> ClientState:
        return self._conn.state

    @state.setter
    def state(self, value: ClientState) -> None:
        self._conn.state = value

    @property
    def node_id(self) -> str:
        return self._conn.node_id

    @property
    def daemon_epoch(self) -> str:
        return self._conn.daemon_epoch

    @property
    def session_id(self) -> str:
        return self._conn.session_id

    @property
    def socket_fallback(self) -> bool:
        """True when this process cannot map the arena: bytes go over gRPC."""
        return self._conn.socket_fallback

    @socket_fallback.setter
    def socket_fallback(self, value: bool) -> None:
        self._conn.socket_fallback = value

    @property
    def registry_version(self) -> int:
        return self._routes.registry_version

    # -- put ------------------------------------------------------------------------

    async def put(
        self,
        obj: Any,
        *,
        to_stage: str,
        request_id: str,
        chunk_id: int | None = None,
        timeout: float | None = None,
        pickle: bool = False,
        key: str | None = None,
        trace_id: str | None = None,
    ) -> DataRef:
        """Publish ``obj`` for ``to_stage``; returns the DataRef to hand to the reader.

        The DataRef is returned as soon as the bytes are published: nothing
        here waits for the reader (waiting first would deadlock a writer whose
        space or credits are all held by DataRefs it has not handed out yet).
        Only a full arena makes a put wait, for space freed by readers.

        With ``key``, the application need not carry the DataRef: the
        consumer stage finds the payload with ``get_key(key,
        from_stage=<this stage>)`` (or ``poll_key``/``take_key``), on any
        node. The put then waits for its daemon to index it (one round trip
        on the session socket; a Peer call when the consumer is served on
        another node) and raises :class:`KeyExistsError` while the same key
        from this stage is still unread by ``to_stage``, or
        :class:`ResourceExhaustedError` when that stage has ``max_stage_keys``
        unread keys; a failed keyed put leaves nothing behind. One whose call
        is cancelled, or runs out of time, before the daemon's answer is
        withdrawn (not indexed, its lease freed) unless a reader took the key
        meanwhile: that put stands. The entry goes when it is read, when
        ``request_id`` is aborted and with the lease TTL.

        ``trace_id`` (up to 128 printable ASCII characters) is the caller's
        own trace id: the daemon logs it at debug level with the lease it
        names, so a slow hop can be followed from the application's traces.
        Puts that need no lease (inline, local_object) send it nowhere.
        """
        if key is not None:
            check_key(key)
        check_timeout(timeout)
        started = time.perf_counter_ns()
        trace = check_trace_id(trace_id)
        ref = await self._put(obj, to_stage, request_id, chunk_id, timeout, pickle, trace)
        if key is not None:
            await _keyed.index(self._conn, ref, key, self._conn.rpc_timeout(timeout))
        return self._put_finished(ref, started)

    def _put_finished(self, ref: DataRef, started_ns: int) -> DataRef:
        """Where every put of either client ends (both clients' put() call it once)."""
        m = ref.fields
        if m.chunk_id >= 0:
            self._writer.count_chunk(m.to_stage, m.request_id, m.chunk_id)
        self._reports.observe(latency.PUT, m, started_ns)
        return ref

    def _get_finished(self, ref: DataRef, obj: Any, started_ns: int) -> Any:
        """Where every get of either client ends (both clients' get() call it once)."""
        self._reports.observe(latency.GET, ref.fields, started_ns)
        return obj

    async def _put(
        self,
        obj: Any,
        to_stage: str,
        request_id: str,
        chunk_id: int | None,
        timeout: float | None,
        pickle: bool,
        trace_id: str = "",
    ) -> DataRef:
        a = self._conn.usable() or await self._conn.ready(timeout)
        laned = self._put_lanes.put(
            a, obj, to_stage, request_id, chunk_id, pickle, trace_id, OFFLOAD_BYTES
        )
        if laned is not None:
            return laned
        w = self._writer
        plan = w.plan(a, obj, to_stage, request_id, chunk_id, pickle)
        route = self._routes.cached(plan.route_key)
        if route is None:
            route = await self._routes.ask(*plan.route_facts)
        # By reference or inline, on a GPU path, or into a lease.
        here = w.put_here(plan, route)
        if here is not None:
            self._put_lanes.learn(plan, here)
            return here
        if self._gpu_paths.may_take(plan):
            gpu_ref = await self._gpu_paths.put(plan, timeout, route)
            if gpu_ref is not None:
                return gpu_ref
        plan.transport, plan.trace_id = leased(route), trace_id
        ref = w.publish_now(plan) or await w.publish(plan, timeout)
        self._put_lanes.learn(plan, ref)
        return ref

    @contextlib.asynccontextmanager
    async def buffer(
        self,
        *,
        to_stage: str,
        request_id: str,
        like: Any,
        chunk_id: int | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[OutBuffer]:
        """Zero-copy put: write the payload straight into relayd memory.

        ``like`` is the payload's shape: any nesting whose tensors give the
        shape and dtype of each output (their data is not read; ``device="meta"``
        tensors are fine). Inside the block, ``out.payload`` is that structure
        with every tensor replaced by a view into a fresh lease - fill them in
        place (``torch.matmul(a, b, out=out.payload["h"])``). Leaving the block
        publishes it and sets ``out.ref``; an exception cancels the lease.
        The views must not be used after the block.
        """

        w = self._writer
        a = self._conn.usable() or await self._conn.ready(timeout)
        plan, tree = w.plan_buffer(a, to_stage, request_id, like, chunk_id)
        lease, start = await w.open_lease(plan, timeout)
        region = self._conn.views[lease.grant.segment][start : start + plan.total]
        out = OutBuffer(_flatten.rebuild(tree, _copies.unpack(region, plan.specs, copy=False)))
        try:
            yield out
        except BaseException:
            out.payload = None
            w.cancel_lease(lease)
            raise
        out.payload = None
        out.ref = w.seal(plan, lease)
        w.count_chunk(plan.to_stage, plan.request_id, plan.chunk_id)

    async def ref(
        self,
        tensor: Any,
        *,
        consumer_stage: str,
        request_id: str,
        timeout: float | None = None,
    ) -> TensorRef:
        """Publish ``tensor`` once for ``consumer_stage`` and return a :class:`TensorRef`.

        Put the TensorRef inside any payload: stages other than the consumer
        get it back untouched (they read none of its bytes) and can forward it
        in their own puts; ``get`` at the consumer materializes the tensor.
        ``abort(request_id)`` frees it if it was not consumed.
        """
        a = self._conn.usable() or await self._conn.ready(timeout)
        plan = self._writer.plan_ref(a, tensor, consumer_stage, request_id)
        await self._writer.publish(plan, timeout)
        return TensorRef(plan.msg)

    # -- stream signals ------------------------------------------------------------

    def put_done(self, to_stage: str, request_id: str, *, chunks: int | None = None) -> DataRef:
        """The end-of-stream signal: control only, no data, nothing to free.

        It carries the number of chunks (by default: one past the highest
        chunk id this client put for the edge), so a reader that gets it
        before the last chunks still waits for them.
        """
        a = self._conn.require_open()
        check_names(to_stage, request_id)
        self._aborts.check(request_id)
        return DataRef(self._writer.signal(a, to_stage, request_id, KIND_DONE, chunks))

    def put_error(self, to_stage: str, request_id: str, message: str) -> DataRef:
        """The stream-failed signal: control only, like :meth:`put_done`.

        The reader's ``stream()`` yields the chunks put before it (their count
        travels in the signal), then raises StreamError(message).
        """
        a = self._conn.require_open()
        check_names(to_stage, request_id)
        msg = self._writer.signal(a, to_stage, request_id, KIND_ERROR, None)
        msg.message = message[:MAX_SIGNAL_MESSAGE]
        return DataRef(msg)

    # -- get ------------------------------------------------------------------------

    async def get(self, ref: DataRef | bytes, *, copy: bool = True) -> Any:
        """The payload ``ref`` stands for. ``copy=False`` returns views into the arena,
        valid until :meth:`release` (prefer :meth:`view`)."""
        started = time.perf_counter_ns()
        ref = ref if isinstance(ref, DataRef) else DataRef.from_bytes(ref)
        self._conn.usable() or await self._conn.ready(None)
        return self._get_finished(ref, await self._reader.get(ref, copy), started)

    async def _get(self, ref: DataRef, copy: bool) -> Any:
        """:meth:`get` for the blocking client's loop."""
        self._conn.usable() or await self._conn.ready(None)
        return await self._reader.get(ref, copy)

    def release(self, ref: DataRef) -> None:
        """Release a ``get(copy=False)``; the views must not be used afterwards."""
        self._reader.release(ref)

    @contextlib.asynccontextmanager
    async def view(self, ref: DataRef | bytes) -> AsyncIterator[Any]:
        """``async with client.view(ref) as obj``: zero-copy tensors valid inside the block."""
        ref = ref if isinstance(ref, DataRef) else DataRef.from_bytes(ref)
        obj = await self.get(ref, copy=False)
        try:
            yield obj
        finally:
            if self._reader.holds_views(ref):
                self.release(ref)

    # -- streams ----------------------------------------------------------------------

    def feed(self, ref: DataRef | bytes) -> None:
        """Hand the client a stream DataRef (chunk, done or error) the app received.

        Chunks may be fed in any order; :meth:`stream` yields them in order.
        """
        ref = ref if isinstance(ref, DataRef) else DataRef.from_bytes(ref)
        self._reader.check_addressed(ref.fields)
        self._streams.feed(ref)

    def stream(
        self, request_id: str, *, from_stage: str, timeout: float | None = None
    ) -> AsyncIterator[Any]:
        """``async for chunk in client.stream(rid, from_stage=...)``: payloads in chunk order.

        Ends after the done signal's last chunk; raises :class:`StreamError`
        at an error signal, :class:`AbortedError` when the request is aborted,
        and :class:`RelayTimeoutError` when no next chunk arrives within
        ``timeout`` seconds (None: wait as long as it takes). A stream is read
        once: when the iteration ends, early too, the chunks it left unread and
        those fed later are discarded, and another ``stream()`` of it raises
        :class:`InvalidArgumentError`.
        """
        check_timeout(timeout)
        return self._streams.chunks(request_id, from_stage, timeout, self.get)

    # -- keyed delivery and discard (see _keyed) ----------------------------------------

    async def take_key(
        self,
        key: str,
        *,
        from_stage: str,
        to_stage: str | None = None,
        timeout: float | None = None,
    ) -> DataRef | None:
        """The DataRef put under ``key`` by ``from_stage`` for ``to_stage``, consumed.

        Waits in the daemon up to ``timeout`` seconds (None: the client's
        default) for the put, then raises :class:`RelayTimeoutError`;
        ``timeout=0`` polls: None when there is no entry yet. Read the
        DataRef with :meth:`get` or :meth:`view` (zero-copy), or free it
        with :meth:`discard`. ``to_stage`` defaults to the client's stage
        (required when it serves several; it must be one of them, else
        :class:`PermissionDeniedError`). A key read, discarded or expired
        before raises :class:`StaleRefError`; one of an aborted request
        :class:`AbortedError`.
        """
        wait = self._conn.rpc_timeout(timeout)
        self._conn.usable() or await self._conn.ready(wait)
        return await _keyed.take(self._conn, self._checks, key, from_stage, to_stage, wait)

    async def get_key(
        self,
        key: str,
        *,
        from_stage: str,
        to_stage: str | None = None,
        timeout: float | None = None,
    ) -> Any:
        """The payload put under ``key``: :meth:`take_key`, then :meth:`get`.

        Waits up to ``timeout`` seconds for it (:class:`RelayTimeoutError`
        after); reading consumes the key, so a second ``get_key`` of it
        raises :class:`StaleRefError`. Its edge's get latency counts from
        this call: the wait for the key included.
        """
        started = time.perf_counter_ns()
        ref = await self.take_key(key, from_stage=from_stage, to_stage=to_stage, timeout=timeout)
        if ref is None:
            raise RelayTimeoutError(f"no put of key {key!r} from {from_stage!r} yet")
        return self._get_finished(ref, await self._reader.get(ref, True), started)

    async def poll_key(
        self,
        key: str,
        *,
        from_stage: str,
        to_stage: str | None = None,
        default: Any = None,
    ) -> Any:
        """The payload put under ``key`` if it is there now, else ``default``; never waits.

        "Not there yet" is not an error. Pass a sentinel as ``default`` when
        None is a payload you put. Reading consumes the key, like
        :meth:`get_key`.
        """
        started = time.perf_counter_ns()
        ref = await self.take_key(key, from_stage=from_stage, to_stage=to_stage, timeout=0)
        if ref is None:
            return default
        return self._get_finished(ref, await self._reader.get(ref, True), started)

    async def discard(self, ref: DataRef | TensorRef | bytes) -> None:
        """Free what ``ref`` holds without reading it.

        Only its writer's stage or the stage it is addressed to may, on any
        node (a reader that gave up, a writer whose consumer will not come):
        holding the ref is no entitlement, and the daemon judges by its own
        record of the lease, not by the ref's fields. Any other stage gets
        :class:`PermissionDeniedError` and nothing is freed. Forwarded
        TensorRefs inside a DataRef go with it where this stage may free them
        (the others stay for their consumer). A ref read or discarded already
        raises :class:`StaleRefError`; an inline one (nothing to free) is only
        marked as read in this process, so that reading or discarding it again
        here is the same error.
        """
        self._conn.usable() or await self._conn.ready(None)
        await _keyed.discard(self._conn, self._checks, ref, self.timeout)

    # -- abort and status -------------------------------------------------------------

    async def abort(self, request_id: str) -> int:
        """Free every lease of ``request_id`` on this node; returns how many were freed."""
        check_request_id(request_id)
        conn = self._conn
        conn.usable() or await conn.ready(None)
        # local_object transfers never reach the daemon, so it cannot tell
        # this process's other readers of the request: _local tells them.
        self._remember_aborted(request_id, tell_others=True)
        conn.flush()  # lingering publishes first: Abort frees what they announce
        try:
            resp = await conn.call("Abort", pb.AbortRequest(request_id=request_id), self.timeout)
        except RelayError:
            self._aborts.forget(request_id)
            raise
        return int(resp.leases_freed)

    async def status(self) -> pb.StatusResponse:
        """The daemon's ``relayd.v1.StatusResponse``: state, node, epoch, pools, peers.

        Who runs what (leases, sessions, stages) is filled in only for
        root, the daemon's uid and ``--admin-gid`` members.
        """
        conn = self._conn
        conn.usable() or await conn.ready(None)
        resp: pb.StatusResponse = await conn.call("Status", pb.StatusRequest(), self.timeout)
        return resp

    def _remember_aborted(self, request_id: str, tell_others: bool = False) -> None:
        # Wake blocked stream readers and drop what can never be read now.
        self._streams.abort(request_id)
        _local.abort(request_id, by=self if tell_others else None)
        self._aborts.remember(request_id)
        self._reader.announced.drop_request(request_id)
        self._writer.forget_chunks(request_id)

    def _local_abort(self, request_id: str) -> None:
        """Another client of this process aborted ``request_id`` (see _local.abort).

        That client may run on another loop (each blocking client has its own
        thread): this one's streams are woken on this one's loop.
        """
        loop = self._loop
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # called from a thread with no loop
            running = None
        if loop is not None and running is not loop:
            with contextlib.suppress(RuntimeError):  # closed: no reader left to wake
                loop.call_soon_threadsafe(self._local_abort, request_id)
            return
        if self._streams.has(request_id):
            self._remember_aborted(request_id)

    # -- session events ---------------------------------------------------------------

    def _on_frame(self, frame: pb.SessionFrame) -> None:
        if frame.HasField("freed"):
            for lease_id in frame.freed.lease_ids:
                lease = self._grants.freed(lease_id)
                if lease is not None:
                    self._conn.free_lease(lease)
            self._grants.collect()  # an empty Freed: a waiting put's ids are in the ring
        for ab in frame.aborted:
            self._remember_aborted(ab.request_id)
        if frame.landed or frame.declined:
            self._reader.hear((frame,))
        for ev in frame.event:
            match ev.kind:
                case pb.EVENT_KIND_BOUND:
                    self._conn.socket_fallback = ev.message == Transport.SOCKET.value
                    self._routes.bound(ev.registry_version)
                case pb.EVENT_KIND_REGISTRY:
                    self._routes.registry(ev.registry_version)
                case pb.EVENT_KIND_DRAINING:
                    self._conn.draining = True
                case pb.EVENT_KIND_RECLAIM:  # the daemon is short of space
                    self._grants.collect()  # idle grants may hide in the ring
                    self._grants.return_idle()
                    self._conn.flush()  # lingering releases free some too
                case pb.EVENT_KIND_ERROR:
                    log.warning("relayd: %s", ev.message)


class OutBuffer:
    """What :meth:`RelayClient.buffer` yields: fill ``payload``, then read ``ref``."""

    __slots__ = ("payload", "ref")

    def __init__(self, payload: Any) -> None:
        self.payload = payload
        self.ref: DataRef | None = None
