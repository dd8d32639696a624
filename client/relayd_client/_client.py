"""RelayClient: the thin client a stage process links.

A put packs the payload's tensors into one contiguous slot run - a lease cut
from a grant this session already holds - stamps the run's header with a
fresh generation, sends one batched notice and returns the DataRef. A get
checks that generation in shared memory, copies out (or hands out views)
and sends a release notice. Neither waits for a daemon round trip; gRPC is
used to attach, to get more grants (a few times per session) and to abort.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import functools
import itertools
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from . import (
    _codec,
    _codec_decode,
    _copies,
    _cuda,
    _cuda_copy,
    _cuda_direct,
    _cuda_facts,
    _cuda_pool,
    _cuda_staging,
    _flatten,
    _header_tree,
    _keyed,
    _local,
    _packing,
    _remote,
)
from ._gpu_order import ReadOnce
from ._grants import Grant, Lease, LeaseTable
from ._refs import TensorRef, substitute
from ._session import SessionChannel
from ._streams import MAX_BUFFERED, Streams
from .wire import latency, peercred
from .wire.dataref import KIND_DATA, KIND_DONE, KIND_ERROR, VERSION, DataRef
from .wire.errors import (
    AbortedError,
    CorruptRefError,
    DaemonUnavailableError,
    DrainingError,
    InvalidArgumentError,
    PeerUnavailableError,
    PermissionDeniedError,
    RelayError,
    RelayTimeoutError,
    ResourceExhaustedError,
    SessionClosedError,
    StaleEpochError,
    StaleRefError,
    StreamError,
)
from .wire.framing import session_socket_path
from .wire.names import check_key, check_request_id, check_stage
from .wire.paths import default_socket_path
from .wire.proto import relay_pb2 as pb
from .wire.proto import relay_pb2_grpc as pb_grpc
from .wire.shm import PROBE_BYTES, SHM_POOL, MappedSegment
from .wire.status import from_rpc_error
from .wire.transport import DIRECT_META_LIMIT, INLINE_LIMIT, Transport
from .wire.version import PROTOCOL_VERSION

log = logging.getLogger(__name__)

ALIGNMENT = 64
# Copies this large run on a worker thread so the event loop keeps serving
# other streams; below it the thread hop costs more than the copy.
OFFLOAD_BYTES = 8 << 20
# Publish, claim and release notices wait this long for company (see
# SessionChannel.mark), as the daemon's Freed notices do: long enough that a
# 50/s stream's chunks, 20 ms apart, share frames, which takes a third off the
# daemon's CPU per chunk (measured). Nobody waits on them:
# readers go by the slot header, and a writer short of space flushes its own
# and has the daemon ask every session for theirs (a RECLAIM event).
NOTICE_LINGER_S = 0.025
_ABORTED_MEMORY = 4096
_LAYOUT_MEMORY = 256  # validated layouts remembered per client (see _checked_specs)
_SHAPE_MEMORY = 256  # payload structures remembered per client (see _shape)
_HEADER_MEMORY = 256  # decoded headers remembered per client (see _decode_header)
_SHAPE_HEADER_BYTES = 4096  # a larger header is not worth keeping as part of a key
# A grant wait that ends this close to its deadline ran out of time; earlier,
# the daemon refused it.
DEADLINE_SLACK_S = 0.01
# Idle grants a session keeps, in default grants' worth of slots.
IDLE_GRANTS = 4
# Re-attach after the daemon went away: retries back off from the first delay
# to the last and keep going while the client is open; each call waits for
# the re-attach only up to its own deadline.
RECONNECT_FIRST_DELAY = 0.05
RECONNECT_MAX_DELAY = 2.0
RECONNECT_CALLER_DELAY = 0.1  # between attempts while a call waits for one
# The socket fallback moves whole packed regions in one gRPC message.
_MAX_MESSAGE = 1 << 30
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE),
    ("grpc.max_receive_message_length", _MAX_MESSAGE),
]
# Transfer and latency reports wait this long for company before they are sent.
REPORT_LINGER_S = 0.2
_MAX_TRACE_ID = 128


class ClientState(enum.Enum):
    UNOPENED = "unopened"
    OPENED = "opened"
    CLOSED = "closed"


def default_socket() -> str:
    """``$RELAYD_SOCKET``, else where ``relayd serve`` listens on its embedded default."""
    return os.environ.get("RELAYD_SOCKET") or default_socket_path()


def _grant(resp: pb.GrantResponse) -> Grant:
    return Grant(
        resp.grant_id, resp.segment, resp.slot, resp.nslots, resp.generation_base, resp.pool
    )


class _Shape:
    """What a put derives from its payload's structure alone; remembered per structure.

    A stage puts the same structure over and over (one hidden-state tensor
    per chunk): the layout, the DataRef's constant fields and the routing
    facts cost ~12 us to derive and nothing to look up (measured).
    """

    __slots__ = ("cuda_uuids", "has_cpu", "specs", "template", "total")

    def __init__(
        self, client: RelayClient, a: pb.AttachResponse, key: _ShapeKey, tensors: Sequence[Any]
    ) -> None:
        to_stage, codec, header, _ = key
        specs, self.total = _packing.plan_layout(tensors, alignment=ALIGNMENT)
        self.specs = _cuda_facts.name_gpus(specs)
        self.has_cpu = any(t.device.type == "cpu" for t in tensors)
        self.cuda_uuids = _cuda_facts.payload_facts(
            [s.device for s in self.specs if s.nbytes]
        ).cuda_uuids
        # Every field but the per-put ones (object and request id, chunk, transport, lease).
        self.template = client._new_msg(a, "", to_stage, -1)
        self.template.ClearField("object_id")
        self.template.ClearField("request_id")
        self.template.header_codec = codec
        self.template.header = header
        _add_layout(self.template, self.specs)


# (to_stage, header codec, header, per tensor: dtype, shape, device, layout, nested)
_ShapeKey = tuple[str, "pb.HeaderCodec", bytes, tuple[tuple[Any, ...], ...]]


class _PutPlan:
    """A put past its shared, synchronous part: what remains is to route and write it."""

    __slots__ = ("msg", "refs", "shape", "tensors")

    def __init__(
        self, msg: pb.DataRef, tensors: list[Any], shape: _Shape, refs: list[TensorRef]
    ) -> None:
        self.msg = msg
        self.tensors = tensors
        self.shape = shape
        self.refs = refs


class _GrantCall:
    """A Grant call in flight for one pool; every put short of space waits on it."""

    __slots__ = ("ended", "nslots", "task", "until")

    def __init__(self, task: asyncio.Task[pb.GrantResponse], nslots: int, until: float) -> None:
        self.task = task
        self.nslots = nslots  # what it asked for
        self.until = until  # its own deadline (monotonic)
        self.ended = until
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[pb.GrantResponse]) -> None:
        self.ended = time.monotonic()
        _retrieve(task)  # the put that started it may have given up: its failure is seen

    def refused(self, nslots: int) -> bool:
        """Did the daemon say no to this ask, not merely run out of time waiting?

        A refusal before the call's deadline means no amount of waiting makes
        room (beyond the stage quota or the largest run), so it holds for any
        put of at least the size asked.
        """
        exc = self.task.exception()
        return (
            isinstance(exc, ResourceExhaustedError)
            and self.ended < self.until - DEADLINE_SLACK_S
            and self.nslots <= nslots
        )


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
        self.stages = (stage,) if isinstance(stage, str) else tuple(stage)
        if not self.stages:
            raise InvalidArgumentError("stage must be a non-empty name or list of names")
        for name in self.stages:
            check_stage(name, "stage")
        self.socket = socket or default_socket()
        self.timeout = timeout
        self.allow_pickle = allow_pickle
        # Only a daemon running as one of these uids is sent anything (see wire/peercred.py).
        self._daemon_uid = daemon_uid
        self._trusted = peercred.trusted_uids(self.socket, daemon_uid)  # a bad uid fails here
        self._pinned: peercred.PinnedSocket | None = None
        self.cuda_ipc_direct = cuda_ipc_direct
        self.state = ClientState.UNOPENED
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.RelayStub | None = None
        self._table = LeaseTable()
        self._session = SessionChannel(self._on_frame, self._on_lost, self._table.lock)
        self._attach: pb.AttachResponse | None = None
        self._segments: list[MappedSegment] = []
        self._views: list[Any] = []
        self._space = asyncio.Event()
        self._grant_calls: dict[str, _GrantCall] = {}  # by pool, the arena included
        self._aborted: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._released: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._valid_layouts: dict[tuple[tuple[bytes, ...], int], list[_packing.TensorSpec]] = {}
        self._headers: dict[bytes, Any] = {}  # see _decode_header
        self._header_bounds: dict[bytes, tuple[int, int]] = {}  # see _slot_bounds
        self._shapes: dict[_ShapeKey, _Shape] = {}  # see _shape()
        self._shapes_for: pb.AttachResponse | None = None
        # Object ids: unique per client without a uuid4 per put.
        self._object_prefix = secrets.token_hex(6) + "-"
        self._object_seq = itertools.count(1)
        self._draining = False
        self._lost = False
        self._reconnect_task: asyncio.Task[None] | None = None
        self._reconnect_now = asyncio.Event()  # a call came: try again at once
        self._reattach_waiters = 0  # calls waiting for the re-attach
        self._held: set[int] = set()
        self._inline_reads = ReadOnce()  # (epoch, object id) of inline DataRefs read
        # cross-node: object id -> the local DataRef a zero-copy get fetched it into
        self._fetched: dict[str, pb.DataRef] = {}
        # Batched reports: (transport, to_stage) -> [count, bytes], and latencies.
        self._reports: dict[tuple[pb.Transport, str], list[int]] = {}
        self._latency = latency.EdgeLatency()
        self._report_due = False
        self._gpu: _cuda.GpuSide | None = None
        # Routing: one answer per (to_stage, payload kind), dropped when the
        # daemon announces a new registry version.
        self._routes: dict[tuple[str, bool, tuple[str, ...]], pb.RouteResponse] = {}
        # Stages the daemon routed to another node: their puts ask for a push.
        self._remote_stages: set[str] = set()
        self.registry_version = 0
        # True when this process cannot map the arena: bytes go over gRPC.
        self.socket_fallback = False
        self._streams = Streams()
        self._chunks: dict[tuple[str, str], int] = {}

    # -- lifecycle ------------------------------------------------------------------

    async def __aenter__(self) -> RelayClient:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        if self.state is ClientState.OPENED:
            return
        if self.state is ClientState.CLOSED:
            raise SessionClosedError("a closed RelayClient cannot be reopened; make a new one")
        await self._connect()
        self.state = ClientState.OPENED
        _local.serve(self.stages, self)

    async def _connect(self) -> None:
        """Attach, map the arena, bind the session socket; undo everything on failure."""
        # Again at every (re)connect: the socket's directory may appear after the client.
        self._trusted = peercred.trusted_uids(self.socket, self._daemon_uid)
        self._pinned = peercred.PinnedSocket(self.socket, self._trusted, self.timeout)
        self._channel = grpc.aio.insecure_channel(
            f"unix:{self._pinned.address}", options=_CHANNEL_OPTIONS
        )
        self._stub = pb_grpc.RelayStub(self._channel)
        try:
            self._attach = await self._stub.Attach(
                pb.AttachRequest(
                    protocol_version=PROTOCOL_VERSION,
                    stages=list(self.stages),
                    pid=os.getpid(),
                    namespaces=_namespaces(),
                    gpu_uuids=list(_cuda_facts.used_gpus()),
                ),
                timeout=self.timeout,
            )
            nonce = self._map_segments(self._attach)
            await self._session.connect(
                session_socket_path(self.socket),
                self._attach.session_id,
                self._attach.session_token,
                self.timeout,
                shm_nonce=nonce,
                trusted=self._trusted,
            )
        except grpc.RpcError as exc:
            await self._teardown()
            raise from_rpc_error(exc) from None
        except BaseException:
            await self._teardown()
            raise
        if self.socket_fallback:
            self._unmap()
        elif self._views:
            self._gpu = _cuda.GpuSide(self._attach, self._views)

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
                self._segments.append(mapped)
                self._views.append(torch.frombuffer(mapped.mm, dtype=torch.uint8))
            if not self._segments:
                return b""
            probe = a.probe_offset
            return bytes(self._segments[0].mm[probe : probe + PROBE_BYTES])
        except (OSError, ValueError) as exc:
            log.warning("cannot map the relayd arena (%s); moving bytes over the socket", exc)
            self._unmap()
            return b""

    def _unmap(self) -> None:
        if self._gpu is not None:
            self._gpu.close()  # unpins the arena: before the views go
            self._gpu = None
        self._views.clear()
        for seg in self._segments:
            seg.close()
        self._segments.clear()

    async def close(self) -> None:
        if self.state is ClientState.CLOSED:
            return
        self.state = ClientState.CLOSED
        _local.unserve(self.stages, self)
        if self._reconnect_task is not None:
            self._reconnect_task.cancel()
            with contextlib.suppress(BaseException):
                await self._reconnect_task
        self._flush_reports()
        await self._teardown()

    # -- reconnect: re-attach after the daemon went away ----------------------------

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
            pending = self._grant_calls.pop(SHM_POOL, None)
            await self._teardown()
            if pending is not None:
                with contextlib.suppress(BaseException):
                    await pending.task
            self._table.clear()
            self._held.clear()
            self._session = SessionChannel(self._on_frame, self._on_lost, self._table.lock)
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
            self._lost = False
            self._draining = False
            log.info("re-attached to relayd (epoch %s)", self.daemon_epoch)
            return

    async def _reattached(self, timeout: float | None) -> None:
        """Wait, up to the call's deadline, for a re-attach in progress."""
        if not self._lost or self.state is not ClientState.OPENED:
            return
        if self._reconnect_task is None or self._reconnect_task.done():
            self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect())
        self._reconnect_now.set()
        self._reattach_waiters += 1
        limit = self.timeout if timeout is None else timeout
        try:
            await asyncio.wait_for(asyncio.shield(self._reconnect_task), max(limit, 0.0))
        except TimeoutError:
            raise DaemonUnavailableError(
                f"the relayd daemon went away and did not come back within {limit:.3g}s"
            ) from None
        finally:
            self._reattach_waiters -= 1

    async def _teardown(self) -> None:
        calls = list(self._grant_calls.values())
        self._grant_calls.clear()
        for call in calls:
            call.task.cancel()
        for call in calls:
            with contextlib.suppress(BaseException):
                await call.task
        if self._gpu is not None:
            # GPU grants go back with the session: no copy may still be queued into them.
            await self._gpu.settle(self.timeout)
        await self._session.close()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        if self._pinned is not None:
            self._pinned.close()
            self._pinned = None
        self._unmap()

    # -- facts ----------------------------------------------------------------------

    @property
    def node_id(self) -> str:
        return self._attach.node_id if self._attach else ""

    @property
    def daemon_epoch(self) -> str:
        return self._attach.daemon_epoch if self._attach else ""

    @property
    def session_id(self) -> str:
        return self._attach.session_id if self._attach else ""

    def _require_open(self) -> pb.AttachResponse:
        if self.state is not ClientState.OPENED or self._attach is None:
            raise SessionClosedError(f"RelayClient is {self.state.value}; use `async with`")
        if self._lost:
            raise DaemonUnavailableError(
                "the relayd daemon went away; re-attaching in the background"
            )
        return self._attach

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
        unread keys; a failed keyed put leaves nothing behind. The entry goes
        when it is read, when ``request_id`` is aborted and with the lease TTL.

        ``trace_id`` (up to 128 printable ASCII characters) is the caller's
        own trace id: the daemon logs it at debug level with the lease it
        names, so a slow hop can be followed from the application's traces.
        Puts that need no lease (inline, local_object) send it nowhere.
        """
        if key is not None:
            check_key(key)
        started = time.perf_counter_ns()
        trace = _check_trace_id(trace_id)
        ref = await self._put(obj, to_stage, request_id, chunk_id, timeout, pickle, trace)
        if key is not None:
            await _keyed.index(self, ref, key, self.timeout if timeout is None else timeout)
        return self._put_finished(ref, started)

    def _put_finished(self, ref: DataRef, started_ns: int) -> DataRef:
        """Where every put of either client ends (both clients' put() call it once)."""
        self._observe(latency.PUT, ref.proto, started_ns)
        return ref

    def _get_finished(self, ref: DataRef, obj: Any, started_ns: int) -> Any:
        """Where every get of either client ends (both clients' get() call it once)."""
        self._observe(latency.GET, ref.proto, started_ns)
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
        if self._lost:  # awaits that never suspend cost ~0.5 us each: skipped
            await self._reattached(timeout)
        a = self._require_open()
        plan = self._plan_put(a, obj, to_stage, request_id, chunk_id, pickle)
        if isinstance(plan, DataRef):
            return plan
        msg, tensors, specs, total = plan.msg, plan.tensors, plan.shape.specs, plan.shape.total
        shape, refs = plan.shape, plan.refs
        cached = self._routes.get((to_stage, shape.has_cpu, shape.cuda_uuids))
        if cached is not None:
            route = int(cached.transport)
        else:
            route = await self._route(to_stage, shape.has_cpu, shape.cuda_uuids)
        # The registry says "same process"; the stage must also still be served
        # here (it may have closed since). A payload with forwarded refs goes
        # the normal way so that get() at the consumer materializes them.
        if route == pb.TRANSPORT_LOCAL_OBJECT and not refs and _local.serves(to_stage):
            return self._put_local(obj, plan)
        if self._gpu is not None and not refs and shape.cuda_uuids:
            gpu_ref = await self._put_gpu(msg, tensors, specs, total, timeout, route)
            if gpu_ref is not None:
                return gpu_ref
        return await self._publish(
            msg, tensors, specs, total, timeout, transport=_leased(route), trace_id=trace_id
        )

    def _plan_put(
        self,
        a: pb.AttachResponse,
        obj: Any,
        to_stage: str,
        request_id: str,
        chunk_id: int | None,
        pickle: bool,
    ) -> DataRef | _PutPlan:
        """The part of a put both clients share: the finished DataRef when it goes inline."""
        _check_names(to_stage, request_id)
        if chunk_id is not None:
            if chunk_id < 0:
                raise InvalidArgumentError("chunk_id must be >= 0")
            key = (to_stage, request_id)
            self._chunks[key] = max(self._chunks.get(key, 0), chunk_id + 1)
        refs: list[TensorRef] = []
        tree, tensors = _flatten.flatten(obj, refs)
        if pickle:
            header, codec = _codec.encode_pickle(tree), pb.HEADER_CODEC_PICKLE
        else:
            header, codec = _codec.encode(tree), pb.HEADER_CODEC_SAFE
        shape = self._shape(a, to_stage, codec, header, tensors)
        specs, total = shape.specs, shape.total
        msg = pb.DataRef()
        msg.CopyFrom(shape.template)
        msg.object_id = f"{self._object_prefix}{next(self._object_seq)}"
        msg.request_id = request_id
        msg.chunk_id = -1 if chunk_id is None else chunk_id
        if refs:
            msg.refs.extend(r.proto for r in refs)
        if len(header) + total + 64 * len(specs) <= INLINE_LIMIT and not (
            chunk_id is not None and tensors
        ):
            msg.transport = pb.TRANSPORT_INLINE
            msg.inline_data = _copies.pack_bytes(tensors, specs, total)
            self._report(pb.TRANSPORT_INLINE, total, to_stage)
            return DataRef(msg)
        if request_id in self._aborted:
            raise AbortedError(f"request {request_id!r} was aborted")
        return _PutPlan(msg, tensors, shape, refs)

    def _put_local(self, obj: Any, plan: _PutPlan) -> DataRef:
        msg = plan.msg
        msg.transport = pb.TRANSPORT_LOCAL_OBJECT
        msg.object_id = f"{_local.process_tag()}-{msg.object_id}"
        _local.put(obj, msg.to_stage, msg.request_id, msg.object_id)
        self._report(
            pb.TRANSPORT_LOCAL_OBJECT, _packing.payload_nbytes(plan.shape.specs), msg.to_stage
        )
        return DataRef(msg)

    def _shape(
        self,
        a: pb.AttachResponse,
        to_stage: str,
        codec: pb.HeaderCodec,
        header: bytes,
        tensors: Sequence[Any],
    ) -> _Shape:
        """The remembered :class:`_Shape` of this payload structure (made on first sight)."""
        key: _ShapeKey = (
            to_stage,
            codec,
            header,
            tuple((t.dtype, t.shape, t.device, t.layout, t.is_nested) for t in tensors),
        )
        if len(header) > _SHAPE_HEADER_BYTES:  # not worth hashing and keeping
            return _Shape(self, a, key, tensors)
        if self._shapes_for is not a:  # a new session: new origin in every template
            self._shapes.clear()
            self._shapes_for = a
        shape = self._shapes.get(key)
        if shape is None:
            shape = _Shape(self, a, key, tensors)
            if len(self._shapes) >= _SHAPE_MEMORY:
                self._shapes.clear()
            self._shapes[key] = shape
        return shape

    def _new_msg(
        self,
        a: pb.AttachResponse,
        request_id: str,
        to_stage: str,
        chunk_id: int,
        kind: int = KIND_DATA,
    ) -> pb.DataRef:
        return pb.DataRef(
            version=VERSION,
            object_id=f"{self._object_prefix}{next(self._object_seq)}",
            request_id=request_id,
            chunk_id=chunk_id,
            to_stage=to_stage,
            kind=kind,
            origin=pb.Origin(
                node_id=a.node_id,
                daemon_epoch=a.daemon_epoch,
                stage=self.stages[0],
                peer_address=a.peer_address,
                mooncake_session=a.mooncake_session,
            ),
        )

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
        import torch

        await self._reattached(timeout)
        a = self._require_open()
        _check_names(to_stage, request_id)
        if self.socket_fallback:
            raise InvalidArgumentError(
                "buffer() needs the shared arena; this client uses the socket fallback"
            )
        tree, shapes = _flatten.flatten(like)
        metas = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in shapes]
        specs, total = _meta_layout(metas)
        msg = self._new_msg(a, request_id, to_stage, -1 if chunk_id is None else chunk_id)
        msg.header_codec = pb.HEADER_CODEC_SAFE
        msg.header = _codec.encode(tree)
        _add_layout(msg, specs)
        lease, start = await self._open_lease(msg, total, timeout)
        region = self._views[lease.grant.segment][start : start + total]
        out = OutBuffer(_flatten.rebuild(tree, _copies.unpack(region, specs, copy=False)))
        try:
            yield out
        except BaseException:
            out.payload = None
            self._cancel_lease(lease)
            raise
        out.payload = None
        out.ref = self._seal_lease(msg, lease, total, ref=False)

    async def _publish(
        self,
        msg: pb.DataRef,
        tensors: Sequence[Any],
        specs: Sequence[_packing.TensorSpec],
        total: int,
        timeout: float | None,
        *,
        ref: bool = False,
        transport: pb.Transport = pb.TRANSPORT_SHM,
        trace_id: str = "",
    ) -> DataRef:
        """Write the packed tensors into a lease (or hand them to the daemon) and publish."""
        self._check_publishable(msg)
        if self.socket_fallback:
            return await self._publish_socket(
                msg, tensors, specs, total, timeout, ref=ref, trace_id=trace_id
            )
        cut = self._lease_now(msg, total, trace_id)  # room in a grant held: no coroutine to enter
        lease, start = (
            cut if cut is not None else await self._open_lease(msg, total, timeout, trace_id)
        )
        view = self._views[lease.grant.segment]
        try:
            if total >= OFFLOAD_BYTES:
                # Addresses for the worker where it can (see _copies.Copy).
                plan = _copies.pack_plan(view, start, total, tensors, specs)
                if plan is not None:
                    await asyncio.to_thread(_copies.run_copies, plan)
                else:
                    # CUDA leaves: the copy runs on the caller's streams, after its producer.
                    streams = _cuda_copy.worker_streams(tensors)
                    await asyncio.to_thread(
                        _cuda_copy.run_on_worker,
                        streams,
                        _copies.pack_at,
                        view,
                        start,
                        total,
                        tensors,
                        specs,
                    )
            elif total:
                _copies.pack_at(view, start, total, tensors, specs)
        except BaseException:
            self._cancel_lease(lease)
            raise
        return self._seal_lease(msg, lease, total, ref=ref, transport=transport)

    async def _open_lease(
        self, msg: pb.DataRef, total: int, timeout: float | None, trace_id: str = ""
    ) -> tuple[Lease, int]:
        """Reserve an arena lease for ``msg``; returns it and where its data starts in its segment."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        lease = await self._reserve(total, deadline)
        self._reserve_notice(lease, msg, trace_id)
        return lease, self._segments[lease.grant.segment].slot_offset(lease.slot)

    def _lease_now(
        self, msg: pb.DataRef, total: int, trace_id: str = ""
    ) -> tuple[Lease, int] | None:
        """:meth:`_open_lease` without waiting: None when no grant held has room."""
        a = self._require_open()
        with self._table.lock:
            lease = self._alloc_local(max(1, -(-total // a.slot_size)))
            if lease is None:
                return None
            self._reserve_notice(lease, msg, trace_id)
        return lease, self._segments[lease.grant.segment].slot_offset(lease.slot)

    def _reserve_notice(self, lease: Lease, msg: pb.DataRef, trace_id: str = "") -> None:
        # Notices are built in place (.add): building one and appending it
        # copies it, ~2 us for a Reserve (measured).
        with self._table.lock:
            notice = self._session.pending.reserve.add(
                lease_id=lease.id,
                grant_id=lease.grant.id,
                slot=lease.slot,
                nslots=lease.nslots,
                generation=lease.id,
                request_id=msg.request_id,
                to_stage=msg.to_stage,
                from_stage=self.stages[0],
            )
            if trace_id:
                notice.trace_id = trace_id

    def _cancel_lease(self, lease: Lease) -> None:
        with self._table.lock:
            self._session.pending.cancel.add(lease_id=lease.id)
            self._free_local(lease)
            self._session.mark()

    def _seal_lease(
        self,
        msg: pb.DataRef,
        lease: Lease,
        total: int,
        *,
        ref: bool,
        transport: pb.Transport = pb.TRANSPORT_SHM,
    ) -> DataRef:
        """Stamp the generation, fill in the DataRef and publish it."""
        if msg.request_id in self._aborted:
            self._cancel_lease(lease)
            raise AbortedError(f"request {msg.request_id!r} was aborted")
        grant = lease.grant
        seg = self._segments[grant.segment]
        gen = lease.id
        seg.write_header(lease.slot, gen, total)
        msg.transport = transport
        out = msg.lease
        out.pool = SHM_POOL
        out.segment = grant.segment
        out.slot = lease.slot
        out.nslots = lease.nslots
        out.offset = seg.slot_offset(lease.slot)
        out.length = total
        out.generation = gen
        out.lease_id = lease.id
        # Most clients route no stage to another node: no field read or write then.
        push = bool(self._remote_stages) and (
            transport == pb.TRANSPORT_SHM and msg.to_stage in self._remote_stages
        )
        if push:  # a fresh message's push is False already
            msg.push = True
        with self._table.lock:
            self._session.pending.publish.add(
                lease_id=lease.id, nbytes=total, transport=transport, ref=ref, push=push
            )
            if push:
                # The daemon starts moving the bytes to the consumer's node when
                # this notice arrives: it must not linger.
                self._session.mark(flush=True)
                return DataRef(msg)
            # The Publish lingers with other notices (one daemon wakeup per batch,
            # not per put: the daemon's CPU per transfer halved, measured). The
            # slot header just written, not the daemon, is what makes the data
            # safe to read meanwhile: a reader's claim or release that overtakes
            # the Publish is held until it lands, and if this process dies first
            # the daemon publishes what the header says was sealed.
            self._session.mark(linger=NOTICE_LINGER_S, holds=total)
        return DataRef(msg)

    async def _publish_socket(
        self,
        msg: pb.DataRef,
        tensors: Sequence[Any],
        specs: Sequence[_packing.TensorSpec],
        total: int,
        timeout: float | None,
        *,
        ref: bool,
        trace_id: str = "",
    ) -> DataRef:
        """Socket fallback: the daemon writes the packed region into a lease for us."""
        import torch

        a = self._require_open()
        assert self._stub is not None
        buf = bytearray(total)
        if total:
            _copies.pack_into(torch.frombuffer(buf, dtype=torch.uint8), tensors, specs)
        wait = self.timeout if timeout is None else timeout
        try:
            resp = await self._stub.PutBytes(
                pb.PutBytesRequest(
                    session_id=a.session_id,
                    session_token=a.session_token,
                    request_id=msg.request_id,
                    to_stage=msg.to_stage,
                    from_stage=self.stages[0],
                    data=bytes(buf),
                    timeout_seconds=wait,
                    ref=ref,
                    trace_id=trace_id,
                ),
                timeout=wait + 1.0,
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        msg.transport = pb.TRANSPORT_SOCKET
        msg.lease.CopyFrom(resp.lease)
        return DataRef(msg)

    async def _route(self, to_stage: str, has_cpu: bool, cuda_uuids: tuple[str, ...] = ()) -> int:
        """The registry's transport for this edge: asked once, then cached until it changes."""
        key = (to_stage, has_cpu, cuda_uuids)
        cached = self._routes.get(key)
        if cached is not None:
            return int(cached.transport)
        a = self._require_open()
        assert self._stub is not None
        version = self.registry_version
        try:
            resp: pb.RouteResponse = await self._stub.Route(
                pb.RouteRequest(
                    session_id=a.session_id,
                    session_token=a.session_token,
                    from_stage=self.stages[0],
                    to_stage=to_stage,
                    encoded_bytes=INLINE_LIMIT + 1,  # inline was ruled out by the caller
                    has_cpu_tensors=has_cpu,
                    cuda_uuids=list(cuda_uuids),
                    inline_meta_bytes=_cuda_facts.direct_meta_estimate(len(cuda_uuids)),
                    allow_cuda_ipc_direct=self.cuda_ipc_direct,
                ),
                timeout=self.timeout,
            )
        except grpc.RpcError as exc:
            # A daemon that cannot route still serves shm (or the socket);
            # not cached, so the next put asks again.
            log.debug("route %s -> %s failed: %s", self.stages[0], to_stage, exc)
            return pb.TRANSPORT_SOCKET if self.socket_fallback else pb.TRANSPORT_SHM
        # An answer computed before a registry change we have seen since is stale.
        if version == self.registry_version and resp.registry_version >= version:
            self.registry_version = max(self.registry_version, resp.registry_version)
            self._routes[key] = resp
            if resp.transport == pb.TRANSPORT_MOONCAKE:
                self._remote_stages.add(to_stage)
            else:
                self._remote_stages.discard(to_stage)
        return int(resp.transport)

    # -- forwarded tensor references ---------------------------------------------------

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
        a = self._require_open()
        msg, specs, total = self._plan_ref(a, tensor, consumer_stage, request_id)
        # Always leased, even when tiny: the point is that forwarding stages
        # carry a fixed-size reference, never the bytes.
        await self._publish(msg, [tensor], specs, total, timeout, ref=True)
        return TensorRef(msg)

    def _plan_ref(
        self, a: pb.AttachResponse, tensor: Any, consumer_stage: str, request_id: str
    ) -> tuple[pb.DataRef, list[_packing.TensorSpec], int]:
        import torch

        _check_names(consumer_stage, request_id)
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(f"ref() takes a tensor, got {type(tensor).__name__}")
        specs, total = _packing.plan_layout([tensor], alignment=ALIGNMENT)
        msg = self._new_msg(a, request_id, consumer_stage, -1)
        msg.header_codec = pb.HEADER_CODEC_SAFE
        msg.header = _codec.encode(_header_tree.TensorSlot(0))
        _add_layout(msg, specs)
        return msg, specs, total

    # -- stream signals ------------------------------------------------------------

    def put_done(self, to_stage: str, request_id: str, *, chunks: int | None = None) -> DataRef:
        """The end-of-stream signal: control only, no data, nothing to free.

        It carries the number of chunks (by default: one past the highest
        chunk id this client put for the edge), so a reader that gets it
        before the last chunks still waits for them.
        """
        a = self._require_open()
        _check_names(to_stage, request_id)
        if request_id in self._aborted:
            raise AbortedError(f"request {request_id!r} was aborted")
        n = self._chunks.pop((to_stage, request_id), 0) if chunks is None else chunks
        if n < 0:
            raise InvalidArgumentError("chunks must be >= 0")
        self._chunks.pop((to_stage, request_id), None)
        msg = self._new_msg(a, request_id, to_stage, n, KIND_DONE)
        msg.transport = pb.TRANSPORT_INLINE
        return DataRef(msg)

    def put_error(self, to_stage: str, request_id: str, message: str) -> DataRef:
        """The stream-failed signal: control only, like :meth:`put_done`.

        The reader's ``stream()`` yields the chunks put before it (their count
        travels in the signal), then raises StreamError(message).
        """
        a = self._require_open()
        _check_names(to_stage, request_id)
        n = self._chunks.pop((to_stage, request_id), 0)
        msg = self._new_msg(a, request_id, to_stage, n, KIND_ERROR)
        msg.transport = pb.TRANSPORT_INLINE
        msg.message = message[:4096]
        return DataRef(msg)

    async def _reserve(self, nbytes: int, deadline: float, pool: str = SHM_POOL) -> Lease:
        a = self._require_open()
        nslots = max(1, -(-nbytes // a.slot_size))
        while True:
            lease = self._alloc_local(nslots, pool)
            if lease is not None:
                return lease
            self._require_open()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ResourceExhaustedError(
                    f"no space for {nbytes} bytes before the deadline (readers may be slow)"
                )
            call = self._grant_calls.get(pool)
            if call is None or call.task.done():
                # No idle grant could take this lease, so none is worth keeping
                # against our quota while we ask for a bigger one. And our
                # lingering publishes go first: readers' releases of those
                # leases wait for them in the daemon, and they may be the space.
                self._return_idle_grants(pool)
                self._session.flush()
                task = asyncio.get_running_loop().create_task(
                    self._request_grant(nslots * a.slot_size, remaining, pool)
                )
                call = self._grant_calls[pool] = _GrantCall(task, nslots, deadline)
            task = call.task
            self._space.clear()
            space = asyncio.ensure_future(self._space.wait())
            try:
                done, _ = await asyncio.wait(
                    {task, space}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                space.cancel()
            if task in done:
                if self._grant_calls.get(pool) is call:
                    del self._grant_calls[pool]
                exc = task.exception()
                # A grant that timed out for a put with a shorter deadline is
                # retried; a timeout within our own deadline, a refusal of
                # this size or any other error is ours.
                if exc is not None and (
                    not isinstance(exc, ResourceExhaustedError)
                    or call.refused(nslots)
                    or time.monotonic() >= deadline - DEADLINE_SLACK_S
                ):
                    lease = self._alloc_local(nslots, pool)
                    if lease is not None:
                        return lease
                    raise exc

    async def _request_grant(
        self, min_bytes: int, timeout: float, pool: str = SHM_POOL
    ) -> pb.GrantResponse:
        a = self._require_open()
        assert self._stub is not None
        try:
            resp: pb.GrantResponse = await self._stub.Grant(
                pb.GrantRequest(
                    session_id=a.session_id,
                    session_token=a.session_token,
                    min_bytes=min_bytes,
                    timeout_seconds=timeout,
                    pool=pool,
                ),
                timeout=timeout + 1.0,
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        # Registered here, once, however many puts were waiting on this task.
        self._add_grant(resp)
        return resp

    def _add_grant(self, resp: pb.GrantResponse) -> None:
        if resp.pool not in ("", SHM_POOL):
            if self._gpu is None or not self._gpu.fits(resp.pool, resp.slot, resp.nslots):
                raise RelayError(f"daemon granted a run outside GPU pool {resp.pool!r}")
        elif (
            resp.segment >= len(self._segments)
            or resp.slot + resp.nslots > self._segments[resp.segment].nslots
        ):
            raise RelayError("daemon granted a run outside its arena")
        try:
            self._table.add(_grant(resp))
        except ValueError:
            raise RelayError(f"daemon granted run {resp.grant_id} twice") from None
        self._space.set()

    def _alloc_local(self, nslots: int, pool: str = SHM_POOL) -> Lease | None:
        return self._table.cut(nslots, pool)

    def _free_local(self, lease: Lease) -> None:
        if self._gpu is not None and lease.grant.pool != SHM_POOL:
            # Not before the writer's copy into these slots is complete.
            self._gpu.free_slots(lease.id, functools.partial(self._slots_back, lease))
            return
        self._slots_back(lease)

    def _slots_back(self, lease: Lease) -> None:
        table = self._table
        with table.lock:
            if table.free(lease.id) is None:
                return
            grant = lease.grant
            a = self._attach
            if grant.live == 0 and a is not None:
                # Keep idle grants up to a budget: a Freed notice can trail the
                # reader's ack, and re-granting costs a gRPC round trip (~1 ms,
                # half a 16 MiB copy). The daemon asks for them back under pressure.
                budget = IDLE_GRANTS * max(a.default_grant_bytes // a.slot_size, 1)
                if table.idle_slots(grant.pool) > budget:
                    self._give_back(grant)
        self._space_freed()

    def _space_freed(self) -> None:
        self._space.set()

    def _give_back(self, grant: Grant) -> None:
        with self._table.lock:
            self._table.drop(grant.id)
            self._session.pending.return_grant.add(grant_id=grant.id)
            self._session.mark()

    def _return_idle_grants(self, pool: str | None = None) -> None:
        with self._table.lock:
            for g in self._table.idle(pool):
                self._give_back(g)

    # -- get ------------------------------------------------------------------------

    async def get(self, ref: DataRef | bytes, *, copy: bool = True) -> Any:
        """The payload ``ref`` stands for. ``copy=False`` returns views into the arena,
        valid until :meth:`release` (prefer :meth:`view`)."""
        started = time.perf_counter_ns()
        ref = ref if isinstance(ref, DataRef) else DataRef.from_bytes(ref)
        return self._get_finished(ref, await self._get(ref, copy), started)

    async def _get(self, ref: DataRef, copy: bool) -> Any:
        if self._lost:
            await self._reattached(None)
        m = ref.proto
        self._check_readable(m)
        transport = ref.transport
        if transport is Transport.LOCAL_OBJECT:
            return self._take_local(m)
        # The whole DataRef, forwarded refs included, is checked before anything
        # is claimed, released, fetched or copied: a forged one consumes nothing.
        tree = self._checked_ref(m)
        if m.refs:
            return await self._get_forwarded(m, tree, copy)
        return await self._read(ref, tree, copy)

    def _checked_ref(self, m: pb.DataRef) -> Any:
        """``m``'s decoded header, once it names only tensors and refs ``m`` carries,
        and the forwarded refs addressed to this client are sound too.

        The layout is checked against the lease where the lease is read
        (:meth:`_lease_region`, :meth:`_get_socket`, :meth:`_get_gpu`), before
        any claim; a foreign lease is pulled first, so its layout is checked here.
        """
        tree = self._decode_header(m)
        need_tensors, need_refs = self._slot_bounds(m, tree)
        if need_tensors > len(m.tensors) or need_refs > len(m.refs):
            raise CorruptRefError(
                f"payload header refers to {need_tensors} tensors and {need_refs} forwarded "
                f"refs, but the DataRef has {len(m.tensors)} and {len(m.refs)}"
            )
        if m.transport == pb.TRANSPORT_SHM and _remote.is_foreign(m, self._require_open().node_id):
            self._checked_specs(m, m.lease.length)
        for r in m.refs:
            if r.to_stage in self.stages and r.kind == KIND_DATA:
                self._checked_ref(r)
        return tree

    def _slot_bounds(self, m: pb.DataRef, tree: Any) -> tuple[int, int]:
        """:func:`_header_tree.slot_bounds` of ``tree``, remembered per safe header."""
        if m.header_codec == pb.HEADER_CODEC_PICKLE:
            return _header_tree.slot_bounds(tree)
        bounds = self._header_bounds.get(m.header)
        if bounds is None:
            bounds = _header_tree.slot_bounds(tree)
            if len(m.header) <= _SHAPE_HEADER_BYTES:
                if len(self._header_bounds) >= _HEADER_MEMORY:
                    self._header_bounds.clear()
                self._header_bounds[m.header] = bounds
        return bounds

    async def _read(self, ref: DataRef, tree: Any, copy: bool) -> Any:
        """The payload of a DataRef without forwarded refs, checked by :meth:`_checked_ref`."""
        m = ref.proto
        transport = ref.transport
        if transport is Transport.INLINE:
            specs, tensors = self._read_inline(m)
            if _cuda_facts.restores_on_gpu(specs):  # small CUDA leaves travel inline too
                tensors = await _cuda_staging.restore_on_device(tensors, specs, copy=False)
            return _flatten.rebuild(tree, tensors)
        # Cross-node: the local daemon pulls the lease into its arena first.
        if transport is Transport.SHM and _remote.is_foreign(ref, self._require_open().node_id):
            m = await _remote.fetch(self._session, self._require_open(), ref, self.timeout)
            if not copy:
                self._fetched[m.object_id] = m
        if transport in (Transport.CUDA_IPC_POOL, Transport.CUDA_IPC_DIRECT):
            return _flatten.rebuild(tree, await self._get_gpu(m, transport, copy))
        if transport not in (Transport.SHM, Transport.SOCKET):
            raise PeerUnavailableError(
                f"{transport.value} DataRefs are not served by this client yet"
            )
        if self.socket_fallback:
            return _flatten.rebuild(tree, await self._get_socket(m))
        seg, start, specs = self._lease_region(m)
        lease = m.lease
        view = self._views[lease.segment]
        # CUDA leaves go straight from the (pinned) arena to this process's GPU.
        on_gpu = _cuda_facts.restores_on_gpu(specs)
        host_copy = copy and not on_gpu
        if host_copy and lease.length >= OFFLOAD_BYTES:
            # Only a copy is worth a thread: a view is the same few
            # microseconds at any size, and the hand-off alone costs ~100.
            self._claim(m)
            # Allocated on this thread (see _copies.allocate), copied on a
            # worker that is given addresses only (see _copies.Copy).
            tensors = _copies.allocate(specs)
            plan = _copies.copy_plan(view.data_ptr() + start, specs, tensors)
            await asyncio.to_thread(_copies.run_copies, plan)
        else:
            tensors = self._read_region(m, view, start, specs, host_copy)
        if on_gpu:
            tensors = await _cuda_staging.restore_on_device(tensors, specs, copy)
        self._end_read(m, seg, copy)
        return _flatten.rebuild(tree, tensors)

    def _check_readable(self, m: pb.DataRef) -> None:
        if m.to_stage not in self.stages:
            raise PermissionDeniedError(
                f"DataRef is addressed to stage {m.to_stage!r}; this client serves {self.stages}"
            )
        if m.kind != KIND_DATA:
            raise InvalidArgumentError(
                "a done/error signal carries no payload; hand it to feed() and read stream()"
            )
        # Whether or not the daemon has freed it yet (the writer's notices may
        # still be on the way), an aborted request's data is not read here.
        self._raise_if_aborted(m)

    def _read_inline(self, m: pb.DataRef) -> tuple[list[_packing.TensorSpec], list[Any]]:
        """An inline DataRef's tensors, once: the same rule as a lease's, kept by the
        reader because inline bytes never reach the daemon."""
        key = (m.origin.daemon_epoch, m.object_id)
        with self._table.lock:  # two threads of a blocking client may race for it
            self._inline_reads.claim(key, "this inline DataRef")
        try:
            data = m.inline_data
            # One allocation and a memcpy per tensor, straight from the bytes.
            specs = self._checked_specs(m, len(data))
            return specs, _copies.unpack_bytes(data, specs)
        except BaseException:
            with self._table.lock:
                self._inline_reads.forget(key)
            raise

    def _read_region(
        self,
        m: pb.DataRef,
        view: Any,
        start: int,
        specs: list[_packing.TensorSpec],
        host_copy: bool,
    ) -> list[Any]:
        """Copies (or views) of a validated lease's tensors, on the calling thread."""
        if host_copy:
            # By address: no slice of the segment to build (see _copies.pack_at).
            return _copies.unpack_from(view.data_ptr() + start, specs)
        # A view (or a GPU restore) outlives this turn: the daemon must
        # know who holds the lease before its TTL could reclaim it
        # (seconds), so the claim may linger like a release and often
        # shares its frame. A short copy is released in this same turn,
        # and the release alone says all the claim would.
        self._claim(m, flush=False)
        region = view[start : start + m.lease.length]
        return _copies.unpack(region, specs, copy=False, validated=True)

    def _end_read(self, m: pb.DataRef, seg: MappedSegment, copy: bool) -> None:
        """The seqlock's second check, then release a copy or hold a view's lease."""
        lease = m.lease
        if seg.read_header(lease.slot)[0] != lease.generation:
            raise StaleRefError("the lease was reclaimed while it was being read; data discarded")
        if copy:
            self._release(m)
        else:
            self._held.add(lease.lease_id)

    # -- GPU paths (see _cuda) ----------------------------------------------------------

    async def _put_gpu(
        self,
        msg: pb.DataRef,
        tensors: list[Any],
        specs: list[Any],
        total: int,
        timeout: float | None,
        route: int,
        streams: Sequence[Any] = (),
    ) -> DataRef | None:
        """A GPU transport for this put, or None when it goes through shm.

        ``streams``: the producer's current streams when this runs on another
        thread than the producer's (the blocking client's loop thread).
        """
        gpu = self._gpu
        if gpu is None or self.socket_fallback:
            return None
        transport = gpu.route(specs, len(msg.header), Transport.from_proto(route))
        if transport is Transport.SHM:
            return None
        if self._draining:
            raise DrainingError("relayd is draining; no new transfers")
        if transport is Transport.CUDA_IPC_DIRECT and self._put_direct(
            msg, tensors, specs, streams
        ):
            self._report(pb.TRANSPORT_CUDA_IPC_DIRECT, total, msg.to_stage)
            return DataRef(msg)
        if not gpu.has_pool_for(specs):
            return None
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        return await self._put_pool(msg, tensors, specs, total, deadline, streams)

    def _put_direct(
        self, msg: pb.DataRef, tensors: list[Any], specs: list[Any], streams: Sequence[Any] = ()
    ) -> bool:
        """cuda_ipc_direct: storage handles in the DataRef; False if they do not fit."""
        # None: PyTorch will not re-export memory it imported over CUDA IPC (a
        # stage forwarding a zero-copy get) or memory of an allocator without
        # IPC (cudaMallocAsync); the pool path copies it instead.
        handles = _cuda_direct.export_all_direct(tensors, specs, streams=streams)
        if handles is not None:
            for layout, spec, h in zip(msg.tensors, specs, handles, strict=True):
                layout.device = spec.device
                if h is not None:
                    layout.cuda_ipc.CopyFrom(h)
            msg.transport = pb.TRANSPORT_CUDA_IPC_DIRECT
            if msg.ByteSize() <= DIRECT_META_LIMIT:
                return True
            for h in handles:  # too big after all: the counts taken go back
                if h is not None and h.ref_counter_handle:
                    _cuda_direct.release_counter(h)
        msg.transport = pb.TRANSPORT_UNSPECIFIED
        for layout in msg.tensors:
            layout.ClearField("cuda_ipc")
        return False

    async def _put_pool(
        self,
        msg: pb.DataRef,
        tensors: list[Any],
        specs: list[Any],
        total: int,
        deadline: float,
        streams: Sequence[Any] = (),
    ) -> DataRef:
        """cuda_ipc_pool: copy into a lease of the source GPU's pool, event in the DataRef."""
        gpu = self._gpu
        assert gpu is not None
        source = _cuda_facts.leaf_gpu(next(s.device for s in specs if s.nbytes))
        desc = gpu.pools[source or ""]
        lease = await self._reserve(total, deadline, desc.name)
        self._reserve_notice(lease, msg)
        try:
            region = gpu.pool_region(desc.name, lease.slot, total)
            event, handle = _cuda_pool.write_pool(region, tensors, specs, streams)
            gpu.keep_event(lease.id, event)
            if msg.request_id in self._aborted:
                raise AbortedError(f"request {msg.request_id!r} was aborted")
        except BaseException:
            self._cancel_lease(lease)
            raise
        # The copy may still run: the header only names the lease, the event orders the bytes.
        gpu.headers[desc.name].write_header(lease.slot, lease.id, total)
        for layout, spec in zip(msg.tensors, specs, strict=True):
            layout.device = spec.device
        msg.transport = pb.TRANSPORT_CUDA_IPC_POOL
        msg.cuda_event = handle
        msg.lease.CopyFrom(
            pb.LeaseRef(
                pool=desc.name,
                segment=0,
                slot=lease.slot,
                nslots=lease.nslots,
                offset=lease.slot * desc.slot_size,
                length=total,
                generation=lease.id,
                lease_id=lease.id,
            )
        )
        with self._table.lock:
            self._session.pending.publish.add(
                lease_id=lease.id, nbytes=total, transport=pb.TRANSPORT_CUDA_IPC_POOL
            )
            self._session.mark(flush=True)
        return DataRef(msg)

    async def _get_gpu(self, m: pb.DataRef, transport: Transport, copy: bool) -> list[Any]:
        gpu = self._gpu
        if gpu is None:
            raise SessionClosedError("RelayClient is not open")
        if transport is Transport.CUDA_IPC_DIRECT:
            if m.origin.node_id != gpu.node_id:
                raise PeerUnavailableError("direct CUDA IPC DataRefs cannot leave their node")
            specs = _specs(m)
            _packing.validate_layout(specs, max((s.offset + s.nbytes for s in specs), default=0))
            if any(_cuda_facts.leaf_gpu(s.device) is None for s in specs if s.nbytes):
                raise CorruptRefError("a direct CUDA IPC DataRef holds a CPU tensor")
            handles = [t.cuda_ipc for t in m.tensors]
            # A second read would give PyTorch's IPC count back twice (freeing early).
            key = (m.origin.daemon_epoch, m.object_id)
            gpu.direct_reads.claim(key, "this direct CUDA IPC DataRef")
            deadline = time.monotonic() + self.timeout
            return await _cuda_direct.read_direct(specs, handles, copy, deadline)
        specs = self._checked_specs(m, m.lease.length)
        self._check_not_released(m)
        try:
            seg, region = gpu.lease_region(m)
        except StaleRefError:
            self._raise_if_aborted(m)
            raise
        self._claim(m)
        try:
            deadline = time.monotonic() + self.timeout
            tensors = await _cuda_pool.read_pool(region, specs, bytes(m.cuda_event), deadline)
        except BaseException:
            # Nothing usable was read (e.g. the writer died before its event could
            # be opened): release rather than hold the claim until this session ends.
            self._release(m)
            raise
        if seg.read_header(m.lease.slot)[0] != m.lease.generation:
            raise StaleRefError("the lease was reclaimed while it was being read; data discarded")
        self._release(m)
        return tensors

    def release(self, ref: DataRef) -> None:
        """Release a ``get(copy=False)``; the views must not be used afterwards."""
        m = self._fetched.pop(ref.proto.object_id, ref.proto)  # cross-node: the local lease
        if m.lease.lease_id not in self._held:
            raise StaleRefError("this DataRef is not held by a zero-copy get (released twice?)")
        self._held.discard(m.lease.lease_id)
        self._release(m)

    @contextlib.asynccontextmanager
    async def view(self, ref: DataRef | bytes) -> AsyncIterator[Any]:
        """``async with client.view(ref) as obj``: zero-copy tensors valid inside the block."""
        ref = ref if isinstance(ref, DataRef) else DataRef.from_bytes(ref)
        obj = await self.get(ref, copy=False)
        try:
            yield obj
        finally:
            if ref.transport in (Transport.SHM, Transport.SOCKET) and not self.socket_fallback:
                self.release(ref)

    def _take_local(self, m: pb.DataRef) -> Any:
        try:
            return _local.take(m.object_id)
        except KeyError:
            if m.request_id in self._aborted:
                raise AbortedError(f"request {m.request_id!r} was aborted") from None
            raise StaleRefError(
                "local_object DataRef is not held in this process (read already, or it comes "
                "from another process)"
            ) from None

    async def _get_forwarded(self, m: pb.DataRef, tree: Any, copy: bool) -> Any:
        """A payload with forwarded refs: ours are materialized, the rest pass through."""
        plain = pb.DataRef()
        plain.CopyFrom(m)
        del plain.refs[:]
        obj = await self._read(DataRef(plain), tree, copy)
        values: list[object] = []
        for r in m.refs:
            if r.to_stage in self.stages:
                values.append(await self._get(DataRef(r), True))
            else:
                values.append(TensorRef(r))
        return substitute(obj, values)

    async def _get_socket(self, m: pb.DataRef) -> list[Any]:
        """Socket fallback: the daemon copies the lease out to us and frees it."""
        import torch

        a = self._require_open()
        assert self._stub is not None
        if m.origin.daemon_epoch != a.daemon_epoch:
            raise StaleEpochError(
                f"DataRef comes from daemon epoch {m.origin.daemon_epoch!r}, not {a.daemon_epoch!r}"
            )
        specs = self._checked_specs(m, m.lease.length)
        try:
            resp = await self._stub.GetBytes(
                pb.GetBytesRequest(
                    session_id=a.session_id,
                    session_token=a.session_token,
                    lease=m.lease,
                    request_id=m.request_id,
                ),
                timeout=self.timeout,
            )
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
            if isinstance(err, StaleRefError) and m.request_id in self._aborted:
                raise AbortedError(f"request {m.request_id!r} was aborted") from None
            raise err from None
        data = bytearray(resp.data)
        if len(data) != m.lease.length:
            raise CorruptRefError(
                f"daemon sent {len(data)} bytes for a {m.lease.length}-byte lease"
            )
        src = (
            torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        )
        return _copies.unpack(src, specs, copy=False)  # the views own `data`

    # -- streams ----------------------------------------------------------------------

    def feed(self, ref: DataRef | bytes) -> None:
        """Hand the client a stream DataRef (chunk, done or error) the app received.

        Chunks may be fed in any order; :meth:`stream` yields them in order.
        """
        ref = ref if isinstance(ref, DataRef) else DataRef.from_bytes(ref)
        m = ref.proto
        if m.to_stage not in self.stages:
            raise PermissionDeniedError(
                f"DataRef is addressed to stage {m.to_stage!r}; this client serves {self.stages}"
            )
        st = self._streams.state(m.request_id, m.origin.stage)
        if m.kind == KIND_DONE:
            st.end = m.chunk_id
        elif m.kind == KIND_ERROR:
            st.error = m.message or "stream failed"
            st.error_at = m.chunk_id
        elif m.chunk_id < 0:
            raise InvalidArgumentError("feed() takes stream chunks (put with chunk_id) and signals")
        elif m.chunk_id >= st.next:
            if len(st.refs) >= MAX_BUFFERED:
                raise ResourceExhaustedError(f"more than {MAX_BUFFERED} chunks buffered")
            st.refs[m.chunk_id] = ref
        if st.aborted or m.request_id in self._aborted:
            st.aborted = True
        st.wake.set()

    async def stream(
        self, request_id: str, *, from_stage: str, timeout: float | None = None
    ) -> AsyncIterator[Any]:
        """``async for chunk in client.stream(rid, from_stage=...)``: payloads in chunk order.

        Ends after the done signal's last chunk; raises :class:`StreamError`
        at an error signal, :class:`AbortedError` when the request is aborted,
        and :class:`RelayTimeoutError` when no next chunk arrives within
        ``timeout`` seconds (None: wait as long as it takes).
        """
        st = self._streams.state(request_id, from_stage)
        if st.consuming:
            raise InvalidArgumentError(f"stream {request_id!r} from {from_stage!r} is read already")
        st.consuming = True
        try:
            while True:
                if st.aborted or request_id in self._aborted:
                    raise AbortedError(f"request {request_id!r} was aborted")
                ref = st.refs.pop(st.next, None)
                if ref is not None:
                    st.next += 1
                    yield await self.get(ref)
                    continue
                if st.error is not None and st.next >= st.error_at:
                    raise StreamError(st.error)
                if st.end is not None and st.next >= st.end:
                    return
                st.wake.clear()
                try:
                    await asyncio.wait_for(st.wake.wait(), timeout)
                except TimeoutError:
                    raise RelayTimeoutError(
                        f"no chunk {st.next} of {request_id!r} within {timeout}s"
                    ) from None
        finally:
            self._streams.discard(request_id, from_stage)

    def _checked_specs(self, m: pb.DataRef, region_len: int) -> list[_packing.TensorSpec]:
        """The layout of ``m``, validated against a region of ``region_len`` bytes.

        A stage reads the same shapes over and over; the verdict for a layout
        is a pure function of (layout, region length), so it is remembered,
        keyed by the raw layout entries, together with the specs built from
        them, which nobody mutates. Building and hashing the specs on every
        get cost ~5 us of the ~7 (measured).
        """
        # Each entry's wire bytes: equal bytes, equal fields (one C call per
        # tensor instead of six attribute reads).
        key = (tuple([t.SerializeToString() for t in m.tensors]), region_len)
        specs = self._valid_layouts.get(key)
        if specs is None:
            specs = _specs(m)
            _packing.validate_layout(specs, region_len)
            if len(self._valid_layouts) >= _LAYOUT_MEMORY:
                self._valid_layouts.clear()
            self._valid_layouts[key] = specs
        return specs

    def _decode_header(self, m: pb.DataRef) -> Any:
        """The header's tree; a safe header seen before is not decoded again.

        Only trees that :func:`_flatten.rebuild` returns fresh are remembered
        (every list and dict in them holds a tensor or ref placeholder), so no
        two gets share a container the application might change.
        """
        header = m.header
        if m.header_codec == pb.HEADER_CODEC_PICKLE:
            return _codec_decode.decode_pickle(header, self.allow_pickle)
        tree = self._headers.get(header)
        if tree is None:
            tree = _codec_decode.decode(header)
            if len(header) <= _SHAPE_HEADER_BYTES and _header_tree.refilled_fresh(tree):
                if len(self._headers) >= _HEADER_MEMORY:
                    self._headers.clear()
                self._headers[header] = tree
        return tree

    def _lease_region(self, m: pb.DataRef) -> tuple[MappedSegment, int, list[_packing.TensorSpec]]:
        """The lease's segment, where its data starts there, and its validated layout."""
        a = self._require_open()
        origin = m.origin
        self._check_not_released(m)
        if origin.daemon_epoch != a.daemon_epoch:
            if origin.node_id == a.node_id:
                raise StaleEpochError(
                    f"DataRef comes from daemon epoch {origin.daemon_epoch!r}; the daemon restarted "
                    f"(now {a.daemon_epoch!r}) and its data is gone"
                )
            raise PeerUnavailableError(
                f"DataRef comes from node {origin.node_id!r}; cross-node "
                "reads need the Mooncake transport"
            )
        lease = m.lease
        if lease.segment >= len(self._segments):
            raise CorruptRefError(f"DataRef names segment {lease.segment} of {len(self._segments)}")
        seg = self._segments[lease.segment]
        if lease.slot + lease.nslots > seg.nslots or lease.length > lease.nslots * seg.slot_size:
            raise CorruptRefError("DataRef lease lies outside the arena")
        if lease.offset != seg.slot_offset(lease.slot):
            raise CorruptRefError("DataRef lease offset does not match its slot")
        specs = self._checked_specs(m, lease.length)
        gen, length = seg.read_header(lease.slot)
        if gen != lease.generation or length != lease.length:
            self._raise_if_aborted(m)
            raise StaleRefError(
                "DataRef's lease was already read, reclaimed (TTL) or aborted; it cannot be read again"
            )
        return seg, lease.offset, specs

    def _check_not_released(self, m: pb.DataRef) -> None:
        # Until the daemon clears the header the bytes are still there: a second
        # read by this process must fail all the same, not depend on timing.
        a = self._require_open()
        if m.lease.lease_id in self._released and m.origin.daemon_epoch == a.daemon_epoch:
            raise StaleRefError("this DataRef was already read and released by this client")

    def _raise_if_aborted(self, m: pb.DataRef) -> None:
        if m.request_id in self._aborted:
            raise AbortedError(f"request {m.request_id!r} was aborted")

    def _check_publishable(self, m: pb.DataRef) -> None:
        """Before a put takes a lease: its request is not aborted, the daemon not draining."""
        self._raise_if_aborted(m)
        if self._draining:
            raise DrainingError("relayd is draining; no new transfers")

    def _claim(self, m: pb.DataRef, flush: bool = True) -> None:
        with self._table.lock:
            self._session.pending.claim.add(
                lease_id=m.lease.lease_id, generation=m.lease.generation
            )
            self._session.mark(flush=flush, linger=NOTICE_LINGER_S)

    def _remember_released(self, lease_id: int) -> None:
        # Until the daemon zeroes the header the bytes are still there; a second
        # read by this process must fail all the same, not depend on timing.
        with self._table.lock:
            self._released[lease_id] = None
            while len(self._released) > _ABORTED_MEMORY:
                self._released.popitem(last=False)

    def _release(self, m: pb.DataRef) -> None:
        with self._table.lock:
            self._remember_released(m.lease.lease_id)
            self._session.pending.release.add(
                lease_id=m.lease.lease_id, generation=m.lease.generation
            )
            self._session.mark(linger=NOTICE_LINGER_S, holds=m.lease.length)

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
        wait = self.timeout if timeout is None else timeout
        await self._reattached(wait)
        self._require_open()
        return await _keyed.take(self, key, from_stage, to_stage, wait)

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
        return self._get_finished(ref, await self._get(ref, True), started)

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
        return self._get_finished(ref, await self._get(ref, True), started)

    async def discard(self, ref: DataRef | TensorRef | bytes) -> None:
        """Free what ``ref`` holds without reading it.

        Holding the ref is the entitlement: any process with the DataRef or
        TensorRef may discard it (a stage forwarding a payload it will not
        read, a reader on another node), and the daemon checks its lease and
        generation, not the caller's stage. Forwarded TensorRefs inside a
        DataRef go with it. A ref read or discarded already raises
        :class:`StaleRefError`; an inline one (nothing to free) is only marked
        as read in this process, so that reading or discarding it again here
        is the same error.
        """
        await self._reattached(None)
        self._require_open()
        await _keyed.discard(self, ref, self.timeout)

    # -- abort ----------------------------------------------------------------------

    async def abort(self, request_id: str) -> int:
        """Free every lease of ``request_id`` on this node; returns how many were freed."""
        check_request_id(request_id)
        await self._reattached(None)
        a = self._require_open()
        assert self._stub is not None
        self._remember_aborted(request_id)
        self._session.flush()  # lingering publishes first: Abort frees what they announce
        # local_object transfers never reach the daemon, so it cannot tell
        # this process's readers of the request; wake them here.
        for other in _local.clients():
            if other is not self and other._streams.has(request_id):
                other._remember_aborted(request_id)
        try:
            resp = await self._stub.Abort(
                pb.AbortRequest(
                    session_id=a.session_id, session_token=a.session_token, request_id=request_id
                ),
                timeout=self.timeout,
            )
        except grpc.RpcError as exc:
            self._aborted.pop(request_id, None)
            raise from_rpc_error(exc) from None
        return int(resp.leases_freed)

    async def status(self) -> pb.StatusResponse:
        """The daemon's ``relayd.v1.StatusResponse``: state, node, epoch, pools, peers.

        Who runs what (leases, sessions, stages) is filled in only for
        root, the daemon's uid and ``--admin-gid`` members.
        """
        await self._reattached(None)
        a = self._require_open()
        assert self._stub is not None
        try:
            resp: pb.StatusResponse = await self._stub.Status(
                pb.StatusRequest(session_id=a.session_id, session_token=a.session_token),
                timeout=self.timeout,
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return resp

    def _remember_aborted(self, request_id: str) -> None:
        # Wake blocked stream readers and drop what can never be read now.
        self._streams.abort(request_id)
        _local.abort(request_id)
        self._aborted[request_id] = None
        while len(self._aborted) > _ABORTED_MEMORY:
            self._aborted.popitem(last=False)

    # -- session events ---------------------------------------------------------------

    def _on_frame(self, frame: pb.SessionFrame) -> None:
        if frame.HasField("freed"):
            for lease_id in frame.freed.lease_ids:
                lease = self._table.leases.get(lease_id)
                if lease is not None:
                    self._free_local(lease)
        for ab in frame.aborted:
            self._remember_aborted(ab.request_id)
        for ev in frame.event:
            match ev.kind:
                case pb.EVENT_KIND_BOUND:
                    self.socket_fallback = ev.message == Transport.SOCKET.value
                    self.registry_version = ev.registry_version
                case pb.EVENT_KIND_REGISTRY:
                    if ev.registry_version != self.registry_version:
                        self.registry_version = ev.registry_version
                        self._routes.clear()
                        self._remote_stages.clear()
                case pb.EVENT_KIND_DRAINING:
                    self._draining = True
                case pb.EVENT_KIND_RECLAIM:  # the daemon is short of space
                    self._return_idle_grants()
                    self._session.flush()  # lingering releases free some too
                case pb.EVENT_KIND_ERROR:
                    log.warning("relayd: %s", ev.message)

    def _on_lost(self) -> None:
        if self.state is ClientState.OPENED:
            log.warning("relayd session lost (daemon stopped or restarted)")
        self._lost = True
        self._space.set()
        if self.state is ClientState.OPENED and (
            self._reconnect_task is None or self._reconnect_task.done()
        ):
            self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect())

    # -- batched reports: transfers the daemon never sees, and every call's latency --

    def _report(self, transport: pb.Transport, nbytes: int, to_stage: str) -> None:
        with self._table.lock:
            entry = self._reports.get((transport, to_stage))
            if entry is None:
                entry = self._reports[transport, to_stage] = [0, 0]
            entry[0] += 1
            entry[1] += nbytes
            self._report_soon()

    def _observe(self, op: int, m: pb.DataRef, start_ns: int) -> None:
        """Count one put or get (of ``m``) of ``start_ns`` ago in its edge's latency buckets."""
        ns = time.perf_counter_ns() - start_ns
        with self._table.lock:
            self._latency.observe(op, m.origin.stage, m.to_stage, m.transport, ns)
            if not self._report_due:  # one call less on every put and get
                self._report_soon()

    def _report_soon(self) -> None:
        # Under the table lock.
        if not self._report_due:
            self._report_due = True
            self._later(REPORT_LINGER_S, self._flush_reports)

    def _later(self, delay: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the client's loop ``delay`` s from now."""
        asyncio.get_running_loop().call_later(delay, callback)

    def _flush_reports(self) -> None:
        with self._table.lock:
            self._report_due = False
            if self._session.closed:
                return
            reports, self._reports = self._reports, {}
            latency = self._latency.drain()
            if not reports and not latency:
                return
            frame = self._session.pending
            for (transport, to_stage), (count, nbytes) in reports.items():
                frame.report.add(
                    transport=transport,
                    count=count,
                    bytes=nbytes,
                    from_stage=self.stages[0],
                    to_stage=to_stage,
                )
            frame.latency.extend(latency)
            self._session.mark(flush=True)


class OutBuffer:
    """What :meth:`RelayClient.buffer` yields: fill ``payload``, then read ``ref``."""

    __slots__ = ("payload", "ref")

    def __init__(self, payload: Any) -> None:
        self.payload = payload
        self.ref: DataRef | None = None


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _meta_layout(tensors: Sequence[Any]) -> tuple[list[_packing.TensorSpec], int]:
    """plan_layout's offsets from shapes and dtypes alone (the tensors hold no data)."""
    specs: list[_packing.TensorSpec] = []
    cursor = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        align = max(ALIGNMENT, t.element_size())
        cursor = -(-cursor // align) * align
        offset = cursor if nbytes else 0
        specs.append(
            _packing.TensorSpec(
                i, tuple(t.shape), _packing.dtype_name(t.dtype), offset, nbytes, "cpu"
            )
        )
        cursor += nbytes
    return specs, cursor


def _add_layout(msg: pb.DataRef, specs: Sequence[_packing.TensorSpec]) -> None:
    for spec in specs:
        msg.tensors.append(
            pb.TensorLayout(
                index=spec.index,
                shape=spec.shape,
                dtype=spec.dtype,
                offset=spec.offset,
                nbytes=spec.nbytes,
                device=spec.device,
            )
        )


def _specs(m: pb.DataRef) -> list[_packing.TensorSpec]:
    return [
        _packing.TensorSpec(
            index=t.index,
            shape=tuple(t.shape),
            dtype=t.dtype,
            offset=t.offset,
            nbytes=t.nbytes,
            device=t.device,
        )
        for t in m.tensors
    ]


def _check_names(to_stage: str, request_id: str) -> None:
    """The rules attach applies to stage names, here, before anything is written."""
    check_stage(to_stage, "to_stage")
    check_request_id(request_id)


def _leased(route: int) -> pb.Transport:
    """The transport a leased put publishes: socket when its reader cannot map the arena."""
    return pb.TRANSPORT_SOCKET if route == pb.TRANSPORT_SOCKET else pb.TRANSPORT_SHM


def _check_trace_id(trace_id: str | None) -> str:
    if trace_id is None:
        return ""
    if (
        not isinstance(trace_id, str)
        or len(trace_id) > _MAX_TRACE_ID
        or not (trace_id.isascii() and trace_id.isprintable())
    ):
        raise InvalidArgumentError(
            f"trace_id must be a string of at most {_MAX_TRACE_ID} printable ASCII characters"
        )
    return trace_id


def _namespaces() -> dict[str, str]:
    out = {}
    for ns in ("pid", "ipc", "mnt"):
        with contextlib.suppress(OSError):
            out[ns] = os.readlink(f"/proc/self/ns/{ns}")
    return out
