"""The writing side of a client: a put's plan, its lease, the copy, the seal.

A put is planned on the caller's thread (:meth:`Writer.plan`: names,
flatten, header, the remembered :class:`Shape`), routed, and then written by
one of the paths here: inline bytes in the DataRef, a same-process object
(:mod:`_local`), a lease cut from a held grant and sealed with its slot header
(:meth:`Writer.publish`), or the socket fallback. The GPU paths
(:mod:`_gpu_paths`) use the same leases and notices. The blocking client runs
the same steps on its caller's thread (:meth:`Writer.lease_now`,
:meth:`Writer.fill_and_seal`) and hands only the waits to its loop.
"""

from __future__ import annotations

import asyncio
import itertools
import operator
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _codec, _copies, _cuda_copy, _cuda_facts, _flatten, _header_tree, _local, _packing
from ._aborts import AbortedRequests
from ._checks import SHAPE_HEADER_BYTES
from ._grants import Lease
from ._notices import Notices
from ._refs import TensorRef
from ._reports import Reports
from ._routes import RouteKey, Routes
from .wire.compact import Shape as CompactShape
from .wire.dataref import KIND_DATA, VERSION, DataRef, compact_put
from .wire.errors import DaemonUnavailableError, DrainingError, InvalidArgumentError
from .wire.names import check_request_id, check_stage
from .wire.proto import relay_pb2 as pb
from .wire.shm import MARK_DIGITS, SHM_POOL, read_mark
from .wire.transport import fits_inline

if TYPE_CHECKING:
    from ._connection import Connection

ALIGNMENT = 64
# Copies this large run on a worker thread so the event loop keeps serving
# other streams; below it the thread hop costs more than the copy.
OFFLOAD_BYTES = 8 << 20
# What one tensor's layout entry adds to an inline DataRef, at most.
_LAYOUT_ENTRY_BYTES = 64
_SHAPE_MEMORY = 256  # payload structures remembered per client (see Writer.shape)
_MAX_TRACE_ID = 128
MAX_SIGNAL_MESSAGE = 4096  # an error signal's text is cut to this


def check_names(to_stage: str, request_id: str) -> None:
    """The rules attach applies to stage names, here, before anything is written."""
    check_stage(to_stage, "to_stage")
    check_request_id(request_id)


# A chunk id or count travels as the DataRef's int64 chunk_id.
MAX_CHUNK = (1 << 63) - 1


def restarted_error() -> DaemonUnavailableError:
    """What a put planned before a restart and leased after it raises (see
    :func:`planned_here`)."""
    return DaemonUnavailableError("relayd restarted during the put; nothing was published")


def planned_here(plan: PutPlan, attach: pb.AttachResponse | None) -> bool:
    """Whether ``plan`` was made under ``attach``, the session attached now. One
    planned before a restart and leased after it (its route or grant spanned
    the re-attach) would name the old daemon's epoch, which readers refuse."""
    return planned_under(plan.attach, attach)


def planned_under(planned: pb.AttachResponse | None, attach: pb.AttachResponse | None) -> bool:
    """:func:`planned_here` of a put planned under ``planned`` (None: not tied to one)."""
    return planned is None or planned is attach


def check_count(value: object, what: str) -> int:
    """``value`` as an int from 0 to :data:`MAX_CHUNK` (numpy ints too), else
    InvalidArgumentError: a float, a bool or a bigger number would fail later,
    as TypeError or ValueError from the DataRef's fields."""
    if not isinstance(value, bool):
        try:
            n = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
        else:
            if 0 <= n <= MAX_CHUNK:
                return n
    raise InvalidArgumentError(f"{what} must be an integer from 0 to 2**63-1, not {value!r}"[:200])


def check_trace_id(trace_id: str | None) -> str:
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


def leased(route: int) -> pb.Transport:
    """The transport a leased put publishes: socket when its reader cannot map the arena."""
    return pb.TRANSPORT_SOCKET if route == pb.TRANSPORT_SOCKET else pb.TRANSPORT_SHM


def add_layout(msg: pb.DataRef, specs: Sequence[_packing.TensorSpec]) -> None:
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


class Shape:
    """What a put derives from its payload's structure alone; remembered per structure.

    A stage puts the same structure over and over (one hidden-state tensor
    per chunk): the layout, the DataRef's constant fields and the routing
    facts take microseconds to derive and nothing to look up.
    """

    __slots__ = (
        "compact", "cuda_uuids", "encoded_bytes", "route_keys", "specs", "template", "total",
    )  # fmt: skip

    def __init__(
        self, template: pb.DataRef, key: ShapeKey, tensors: Sequence[Any], compact: bool
    ) -> None:
        to_stage, codec, header, _ = key
        specs, self.total = _packing.plan_layout(tensors, alignment=ALIGNMENT)
        self.specs = _cuda_facts.name_gpus(specs)
        has_cpu = any(t.device.type == "cpu" for t in tensors)
        self.cuda_uuids = _cuda_facts.payload_facts(
            [s.device for s in self.specs if s.nbytes]
        ).cuda_uuids
        # What the router is told about the size: the whole encoded put.
        self.encoded_bytes = len(header) + self.total + _LAYOUT_ENTRY_BYTES * len(specs)
        # The route key of a put of this shape, by whether it is a stream chunk
        # carrying tensors (never inline): looked up, not built, per put.
        fits = fits_inline(self.encoded_bytes)
        self.route_keys: tuple[RouteKey, RouteKey] = (
            (to_stage, has_cpu, self.cuda_uuids, fits),
            (to_stage, has_cpu, self.cuda_uuids, False),
        )
        # Every field but the per-put ones (object and request id, chunk, transport, lease).
        self.template = template
        self.template.ClearField("object_id")
        self.template.ClearField("request_id")
        self.template.ClearField("chunk_id")
        self.template.header_codec = codec
        self.template.header = header
        add_layout(self.template, self.specs)
        # The compact DataRef's shape part (wire.compact): these same fields,
        # encoded once; None where the daemon reads only version 1.
        self.compact = (
            CompactShape(template, template.SerializeToString(deterministic=True))
            if compact
            else None
        )


# ref() and buffer() take a lease without asking the router.
NOT_ROUTED: RouteKey = ("", False, (), False)

# (to_stage, header codec, header, per tensor: dtype, shape, device, layout, nested)
ShapeKey = tuple[str, "pb.HeaderCodec", bytes, tuple[tuple[Any, ...], ...]]


@dataclass(slots=True, eq=False)
class PutPlan:
    """A put past its shared, synchronous part: what remains is to route and write it.

    Its DataRef message (:attr:`msg`) is built only when a path needs one: a
    plain put to a lease or inline, where its daemon reads compact DataRefs,
    never does (:attr:`compact`).
    """

    obj: Any
    tensors: list[Any]
    specs: list[_packing.TensorSpec]
    total: int
    to_stage: str
    request_id: str
    object_id: str
    chunk_id: int
    refs: Sequence[TensorRef] = ()
    cuda_uuids: tuple[str, ...] = ()
    # How the router is asked (see Shape.route_keys).
    route_key: RouteKey = NOT_ROUTED
    encoded_bytes: int = 0
    chunk_carries_tensors: bool = False
    # How it is published: a TensorRef's lease, the leased transport the route
    # gave (shm, or socket for a reader that cannot map the arena), and the
    # caller's trace id for the daemon's log.
    is_ref: bool = False
    transport: pb.Transport = pb.TRANSPORT_SHM
    trace_id: str = ""
    # The fields its structure fixes (Shape.template), the shape part of its
    # compact DataRef (None: it is written as a message), and the message,
    # once built.
    template: pb.DataRef | None = None
    shape: CompactShape | None = None
    built: pb.DataRef | None = None
    # The attach it was planned under: its DataRef names that daemon's epoch.
    attach: pb.AttachResponse | None = None

    @classmethod
    def of(
        cls, obj: Any, msg: pb.DataRef, tensors: list[Any], specs: list[_packing.TensorSpec],
        total: int, **kw: Any,
    ) -> PutPlan:  # fmt: skip
        """A plan of a put whose message is built already."""
        return cls(
            obj, tensors, specs, total, msg.to_stage, msg.request_id, msg.object_id,
            msg.chunk_id, built=msg, **kw,
        )  # fmt: skip

    @property
    def msg(self) -> pb.DataRef:
        """The put as a ``relayd.v1.DataRef`` message, built on first use. Once
        built, it is what the put publishes (a path may have added to it)."""
        if self.built is None:
            assert self.template is not None
            m = self.built = pb.DataRef()
            m.CopyFrom(self.template)
            m.object_id = self.object_id
            m.request_id = self.request_id
            m.chunk_id = self.chunk_id
        return self.built

    @property
    def compact(self) -> CompactShape | None:
        """The shape part to write this put's DataRef compact with; None: a message."""
        return self.shape if self.built is None else None

    @property
    def fits_inline(self) -> bool:
        return self.route_key[3]

    @property
    def route_facts(self) -> tuple[RouteKey, int, bool, bool]:
        """What :meth:`Routes.ask` tells the router about this put."""
        return (
            self.route_key,
            self.encoded_bytes,
            self.chunk_id >= 0,
            self.chunk_carries_tensors,
        )


class ObjectIds:
    """The object ids of one client's puts: unique, and each unguessable from the others.

    A random prefix of the client's, a sequence number (unique without a uuid4
    per put), and 64 random bits of the put's own, last: its lease's read mark
    (:func:`~relayd_client.wire.shm.read_mark`), which a stage holding another
    DataRef of this writer must not be able to tell. They are drawn in batches,
    each part for one sequence number only (an id costs ~0.3 us so, ~0.75 with
    a ``getrandom`` of its own, ~0.1 with none), without a lock: puts come
    from any thread, and ``setdefault`` keeps one batch per number.
    """

    BATCH = 1024

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(6) + "-"
        self._seq = itertools.count(1)
        self._batches: dict[int, str] = {}  # by their first number: this one and the last
        self._current = (-self.BATCH, "")  # (first number, random parts): read as one

    def next(self) -> str:
        n = next(self._seq)
        first, parts = self._current
        i = n - first
        if not 0 <= i < self.BATCH:
            first = n - n % self.BATCH
            parts = self._batches.setdefault(first, os.urandom(MARK_DIGITS // 2 * self.BATCH).hex())
            self._batches.pop(first - 2 * self.BATCH, None)
            self._current = (first, parts)
            i = n - first
        at = MARK_DIGITS * i
        return f"{self._prefix}{n}-{parts[at : at + MARK_DIGITS]}"


class Writer:
    """Puts of one client; collaborators are the connection's parts, not the client."""

    def __init__(
        self,
        conn: Connection,
        notices: Notices,
        aborts: AbortedRequests,
        reports: Reports,
        routes: Routes,
    ) -> None:
        self._conn = conn
        self._grants = conn.grants
        self._lock = conn.lock
        self._notices = notices
        self._aborts = aborts
        self._reports = reports
        self._routes = routes
        self._stage = conn.stages[0]
        self._object_ids = ObjectIds()
        self._shapes: dict[ShapeKey, Shape] = {}
        # Headers of dicts of tensors, by their keys (see _flatten.flat_tensors).
        self._flat_headers: dict[tuple[str, ...], bytes] = {}
        self._shapes_for: pb.AttachResponse | None = None
        self.chunks: dict[tuple[str, str], int] = {}  # one past the highest chunk id put

    # -- plan -------------------------------------------------------------------------

    def plan(
        self,
        a: pb.AttachResponse,
        obj: Any,
        to_stage: str,
        request_id: str,
        chunk_id: int | None,
        pickle: bool,
    ) -> PutPlan:
        """The part of a put both clients share, up to the facts the router needs."""
        check_names(to_stage, request_id)
        chunk = self._chunk(chunk_id)
        refs: list[TensorRef] = []
        flat = None if pickle else _flatten.flat_tensors(obj)
        if flat is not None:  # the common payload: its header is remembered by its keys
            header, tensors = self._flat_headers.get(flat[0]), flat[1]
            if header is None:
                header = self._flat_header(obj, flat[0])
            codec = pb.HEADER_CODEC_SAFE
        else:
            tree, tensors = _flatten.flatten(obj, refs)
            if pickle:
                header, codec = _codec.encode_pickle(tree), pb.HEADER_CODEC_PICKLE
            else:
                header, codec = _codec.encode(tree), pb.HEADER_CODEC_SAFE
        shape = self.shape(a, to_stage, codec, header, tensors)
        carries = chunk_id is not None and bool(tensors)
        plan = PutPlan(
            obj, tensors, shape.specs, shape.total, to_stage, request_id, self.object_id(),
            chunk, refs, shape.cuda_uuids,
            shape.route_keys[carries], shape.encoded_bytes, carries, template=shape.template,
            attach=a,
        )  # fmt: skip
        if refs:
            plan.msg.refs.extend(r.proto for r in refs)
        else:
            plan.shape = shape.compact
        return plan

    def _flat_header(self, obj: Any, keys: tuple[str, ...]) -> bytes:
        """The header of a dict of tensors under ``keys``: walked and encoded
        once (any refusal raises as for every payload), then remembered."""
        tree, _ = _flatten.flatten(obj)
        header = _codec.encode(tree)
        if len(header) <= SHAPE_HEADER_BYTES:
            if len(self._flat_headers) >= _SHAPE_MEMORY:
                self._flat_headers.clear()
            self._flat_headers[keys] = header
        return header

    def shape(
        self,
        a: pb.AttachResponse,
        to_stage: str,
        codec: pb.HeaderCodec,
        header: bytes,
        tensors: Sequence[Any],
    ) -> Shape:
        """The remembered :class:`Shape` of this payload structure (made on first sight)."""
        key: ShapeKey = (
            to_stage,
            codec,
            header,
            tuple((t.dtype, t.shape, t.device, t.layout, t.is_nested) for t in tensors),
        )
        if len(header) > SHAPE_HEADER_BYTES:  # not worth hashing and keeping
            return Shape(self.new_msg(a, "", to_stage, -1), key, tensors, a.compact_refs)
        if self._shapes_for is not a:  # a new session: new origin in every template
            self._shapes.clear()
            self._shapes_for = a
        shape = self._shapes.get(key)
        if shape is None:
            shape = Shape(self.new_msg(a, "", to_stage, -1), key, tensors, a.compact_refs)
            if len(self._shapes) >= _SHAPE_MEMORY:
                self._shapes.clear()
            self._shapes[key] = shape
        return shape

    def _chunk(self, chunk_id: int | None) -> int:
        """The DataRef's chunk id (-1: not a chunk); counted once its put is done."""
        return -1 if chunk_id is None else check_count(chunk_id, "chunk_id")

    def count_chunk(self, to_stage: str, request_id: str, chunk: int) -> None:
        """A chunk is out (put() and buffer() alike): :meth:`signal`'s default
        counts it. Not before: a put that raised put no chunk, and a count
        past it would leave the reader waiting for it."""
        if chunk < 0 or request_id in self._aborts:
            return
        key = (to_stage, request_id)
        with self._lock:  # the blocking client's threads put chunks of one stream
            self.chunks[key] = max(self.chunks.get(key, 0), chunk + 1)

    def forget_chunks(self, request_id: str) -> None:
        """An aborted request's streams end without a signal: stop counting them."""
        with self._lock:
            for key in [key for key in self.chunks if key[1] == request_id]:
                del self.chunks[key]

    def object_id(self) -> str:
        return self._object_ids.next()

    def new_msg(
        self,
        a: pb.AttachResponse,
        request_id: str,
        to_stage: str,
        chunk_id: int,
        kind: int = KIND_DATA,
    ) -> pb.DataRef:
        return pb.DataRef(
            version=VERSION,
            object_id=self.object_id(),
            request_id=request_id,
            chunk_id=chunk_id,
            to_stage=to_stage,
            kind=kind,
            origin=pb.Origin(
                node_id=a.node_id,
                daemon_epoch=a.daemon_epoch,
                stage=self._stage,
                peer_address=a.peer_address,
                mooncake_session=a.mooncake_session,
            ),
        )

    def plan_ref(
        self, a: pb.AttachResponse, tensor: Any, consumer_stage: str, request_id: str
    ) -> PutPlan:
        import torch

        check_names(consumer_stage, request_id)
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(f"ref() takes a tensor, got {type(tensor).__name__}")
        specs, total = _packing.plan_layout([tensor], alignment=ALIGNMENT)
        msg = self.new_msg(a, request_id, consumer_stage, -1)
        msg.header_codec = pb.HEADER_CODEC_SAFE
        msg.header = _codec.encode(_header_tree.TensorSlot(0))
        add_layout(msg, specs)
        # Always leased, even when tiny: the point is that forwarding stages
        # carry a fixed-size reference, never the bytes.
        return PutPlan.of(tensor, msg, [tensor], specs, total, is_ref=True, attach=a)

    def plan_buffer(
        self, a: pb.AttachResponse, to_stage: str, request_id: str, like: Any, chunk_id: int | None
    ) -> tuple[PutPlan, Any]:
        """A buffer()'s plan (no tensors: the caller writes them) and header tree,
        from ``like``'s shapes and dtypes."""
        import torch

        check_names(to_stage, request_id)
        if self._conn.socket_fallback:
            raise InvalidArgumentError(
                "buffer() needs the shared arena; this client uses the socket fallback"
            )
        tree, shapes = _flatten.flatten(like)
        # Stand-ins with the shape and dtype but one element of storage each:
        # `like`'s tensors may hold no data at all (device="meta").
        stand_ins = [torch.empty((), dtype=t.dtype).expand(t.shape) for t in shapes]
        specs, total = _packing.plan_layout(stand_ins, alignment=ALIGNMENT)
        msg = self.new_msg(a, request_id, to_stage, self._chunk(chunk_id))
        msg.header_codec = pb.HEADER_CODEC_SAFE
        msg.header = _codec.encode(tree)
        add_layout(msg, specs)
        return PutPlan.of(None, msg, [], specs, total, attach=a), tree

    def signal(
        self, a: pb.AttachResponse, to_stage: str, request_id: str, kind: int, chunks: int | None
    ) -> pb.DataRef:
        """A done or error signal: control only, inline, nothing to free."""
        check_names(to_stage, request_id)
        given = None if chunks is None else check_count(chunks, "chunks")
        counted = self.chunks.pop((to_stage, request_id), 0)  # checked first: kept on a bad count
        msg = self.new_msg(a, request_id, to_stage, counted if given is None else given, kind)
        msg.transport = pb.TRANSPORT_INLINE
        return msg

    # -- the paths a planned put takes -------------------------------------------------

    def put_here(self, plan: PutPlan, route: int) -> DataRef | None:
        """The put when it needs no lease (by reference in this process, or inline); else None."""
        to_stage = plan.to_stage
        if route == pb.TRANSPORT_LOCAL_OBJECT and (plan.refs or not _local.serves(to_stage)):
            # Not by reference after all: a payload with forwarded refs goes the
            # normal way so that get() at the consumer materializes them, and
            # the stage may have closed since. The router's answer for another
            # process of this node follows: inline when it fits, else a lease.
            route = pb.TRANSPORT_INLINE if plan.fits_inline else pb.TRANSPORT_SHM
        if route == pb.TRANSPORT_INLINE:
            data = self.inline_bytes(plan.tensors, plan.specs, plan.total, to_stage)
            shape = plan.compact
            if shape is not None:
                return compact_put(
                    shape, plan.chunk_id, plan.request_id, plan.object_id, inline_data=data
                )
            msg = plan.msg
            msg.transport = pb.TRANSPORT_INLINE
            msg.inline_data = data
            return DataRef(msg)
        # Inline bytes never reach the daemon: an abort is the reader's to see.
        # Everything else of an aborted request stops here.
        self._aborts.check(plan.request_id)
        if route != pb.TRANSPORT_LOCAL_OBJECT:
            return None
        msg = plan.msg
        msg.transport = pb.TRANSPORT_LOCAL_OBJECT
        msg.object_id = f"{_local.process_tag()}-{msg.object_id}"
        _local.put(plan.obj, to_stage, msg.request_id, msg.object_id)
        self._reports.transfer(
            pb.TRANSPORT_LOCAL_OBJECT, _packing.payload_nbytes(plan.specs), to_stage
        )
        return DataRef(msg)

    def inline_bytes(
        self, tensors: list[Any], specs: list[_packing.TensorSpec], total: int, to_stage: str
    ) -> bytes:
        """An inline put's payload, packed, and counted as sent to ``to_stage``."""
        data = _copies.pack_bytes(tensors, specs, total)
        self._reports.transfer(pb.TRANSPORT_INLINE, total, to_stage)
        return data

    def check_publishable(self, request_id: str) -> None:
        """Before a put takes a lease: its request is not aborted, the daemon not draining."""
        self._aborts.check(request_id)
        if self._conn.draining:
            raise DrainingError("relayd is draining; no new transfers")

    def publish_now(self, plan: PutPlan) -> DataRef | None:
        """:meth:`publish` when it needs no wait: a held grant has room for a
        short copy (no coroutine entered, the common case). Else None."""
        if plan.total >= OFFLOAD_BYTES or self._conn.socket_fallback:
            return None
        self.check_publishable(plan.request_id)
        cut = self.lease_now(plan)
        return None if cut is None else self.fill_and_seal(plan, *cut)

    async def publish(self, plan: PutPlan, timeout: float | None) -> DataRef:
        """Write the packed tensors into a lease (or hand them to the daemon) and publish."""
        total = plan.total
        self.check_publishable(plan.request_id)
        if self._conn.socket_fallback:
            return await self.publish_socket(plan, timeout)
        cut = self.lease_now(plan)  # room in a grant held: no coroutine to enter
        lease, start = cut if cut is not None else await self.open_lease(plan, timeout)
        if total < OFFLOAD_BYTES:
            return self.fill_and_seal(plan, lease, start)
        with self._lock:
            view = self._conn.arena(lease)[1]  # held: outlives a concurrent teardown
        tensors, specs = plan.tensors, plan.specs
        try:
            # Addresses for the worker where it can (see _copies.Copy).
            copies = _copies.pack_plan(view, start, total, tensors, specs)
            if copies is not None:
                await asyncio.to_thread(_copies.run_copies, copies)
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
        except BaseException:
            self.cancel_lease(lease)
            raise
        return self.seal(plan, lease)

    def fill_and_seal(self, plan: PutPlan, lease: Lease, start: int) -> DataRef:
        """Copy into the lease on this thread, then seal it; a failed copy cancels it.

        The DataRef is made before the copy: whatever runs after a copy of a
        megabyte or more finds its objects evicted from the cache, and costs
        several times what it does before (sealing took 26 us at 256 KiB,
        142 at 4 MiB, measured).
        """
        ref, push = self._ref_for(plan, lease, start)
        with self._lock:  # a re-attach may have mapped another daemon's arena since the cut
            view = self._conn.arena(lease)[1]  # held: outlives a concurrent close
        try:
            if plan.total:
                _copies.pack_at(view, start, plan.total, plan.tensors, plan.specs)
        except BaseException:
            self.cancel_lease(lease)
            raise
        self._seal_header(plan, lease, push)
        return ref

    async def open_lease(self, plan: PutPlan, timeout: float | None) -> tuple[Lease, int]:
        """Reserve an arena lease for ``plan``; returns it and where its data starts in its segment."""
        deadline = time.monotonic() + self._conn.rpc_timeout(timeout)
        lease = await self._grants.reserve(plan.total, deadline)
        with self._lock:
            seg = self._conn.arena(lease)[0]
            self._notices.reserve(lease, plan.request_id, plan.to_stage, plan.trace_id)
        return lease, seg.slot_offset(lease.slot)

    def lease_now(self, plan: PutPlan) -> tuple[Lease, int] | None:
        """:meth:`open_lease` without waiting: None when no grant held has room."""
        return self.cut_now(plan.total, plan.request_id, plan.to_stage, plan.trace_id)

    def cut_now(
        self, total: int, request_id: str, to_stage: str, trace_id: str
    ) -> tuple[Lease, int] | None:
        """A lease of ``total`` bytes from a grant held, its Reserve queued, and
        where its data starts in its segment; None when no grant held has room."""
        self._conn.require_open()
        with self._lock:
            lease = self._grants.cut(total)
            if lease is None:
                return None
            seg = self._conn.arena(lease)[0]  # the daemon may have gone since require_open
            self._notices.reserve(lease, request_id, to_stage, trace_id)
        return lease, seg.slot_offset(lease.slot)

    def cancel_lease(self, lease: Lease) -> None:
        self._notices.cancel(lease)

    def seal(self, plan: PutPlan, lease: Lease) -> DataRef:
        """Stamp the generation, fill in the DataRef and publish it (the data is in)."""
        with self._lock:
            offset = self._conn.arena(lease)[0].slot_offset(lease.slot)
        ref, push = self._ref_for(plan, lease, offset)
        self._seal_header(plan, lease, push)
        return ref

    def _ref_for(self, plan: PutPlan, lease: Lease, offset: int) -> tuple[DataRef, bool]:
        """The DataRef ``plan`` publishes in ``lease`` (its data at ``offset`` in its
        segment), and whether the daemon pushes it to the consumer's node."""
        total, transport = plan.total, plan.transport
        # Most clients route no stage to another node: no look-up then.
        remote = self._routes.remote_stages
        push = bool(remote) and (transport == pb.TRANSPORT_SHM and plan.to_stage in remote)
        grant = lease.grant
        gen = lease.id
        shape = plan.compact
        # A push's DataRef is read by another node's daemon too: a message,
        # which a peer of any version reads.
        if shape is not None and not push and transport == pb.TRANSPORT_SHM:
            ref = compact_put(
                shape, plan.chunk_id, plan.request_id, plan.object_id,
                (grant.segment, lease.slot, lease.nslots, offset, total, gen, lease.id),
            )  # fmt: skip
            return ref, push
        msg = plan.msg
        msg.transport = transport
        out = msg.lease
        out.pool = SHM_POOL
        out.segment = grant.segment
        out.slot = lease.slot
        out.nslots = lease.nslots
        out.offset = offset
        out.length = total
        out.generation = gen
        out.lease_id = lease.id
        if push:  # a fresh message's push is False already
            msg.push = True
        return DataRef(msg), push

    def _seal_header(self, plan: PutPlan, lease: Lease, push: bool) -> None:
        self.seal_lease(
            lease, plan.total, plan.request_id, plan.object_id, plan.attach,
            plan.transport, ref=plan.is_ref, push=push,
        )  # fmt: skip

    def seal_lease(
        self,
        lease: Lease,
        total: int,
        request_id: str,
        object_id: str,
        attach: pb.AttachResponse | None,
        transport: pb.Transport = pb.TRANSPORT_SHM,
        *,
        ref: bool = False,
        push: bool = False,
    ) -> None:
        """Stamp the lease's generation in its slot header and publish it: readers
        may read it from here on. Raises, the lease cancelled, if its request was
        aborted or its daemon went away since ``attach``, the one it was planned under."""
        if request_id in self._aborts:
            self.cancel_lease(lease)
            self._aborts.check(request_id)
        # With push, the daemon starts moving the bytes to the consumer's node
        # when the notice arrives; a reader on the socket fallback reads through
        # the daemon, which serves it once the notice is in: neither may linger.
        now = push or transport == pb.TRANSPORT_SOCKET
        conn = self._conn
        with self._lock:  # a re-attach swaps the session and clears the leases under it
            # The daemon went away during the copy: the lease died with it,
            # and the new one's arena and session are not this lease's.
            seg = conn.arena(lease)[0]
            if not planned_under(attach, conn.attach):
                self.cancel_lease(lease)
                raise restarted_error()
            seg.write_header(lease.slot, lease.id, total)
            if self._notices.publish(lease, total, transport, ref=ref, push=push, now=now):
                self._grants.table.watch(lease, seg, read_mark(object_id, lease.id))

    async def publish_socket(self, plan: PutPlan, timeout: float | None) -> DataRef:
        """Socket fallback: the daemon writes the packed region into a lease for us."""
        import torch

        msg = plan.msg
        buf = bytearray(plan.total)
        if plan.total:
            _copies.pack_into(torch.frombuffer(buf, dtype=torch.uint8), plan.tensors, plan.specs)
        wait = self._conn.rpc_timeout(timeout)
        if not planned_here(plan, self._conn.require_open()):
            raise restarted_error()
        resp = await self._conn.call(
            "PutBytes",
            pb.PutBytesRequest(
                request_id=msg.request_id,
                to_stage=msg.to_stage,
                from_stage=self._stage,
                data=bytes(buf),
                timeout_seconds=wait,
                ref=plan.is_ref,
                trace_id=plan.trace_id,
            ),
            wait + 1.0,
        )
        msg.transport = pb.TRANSPORT_SOCKET
        msg.lease.CopyFrom(resp.lease)
        return DataRef(msg)
