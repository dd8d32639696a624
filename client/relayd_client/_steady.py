"""Lanes: the put and the get of a payload structure this client handled before, in one pass.

A stage puts and reads the same structure over and over: one hidden-state
tensor per chunk, to the same stage, under the same attach. The general path
derives each put's plan and checks each read step by step, through the
writer's and reader's collaborators; after the pause between two calls
(a stream's chunks come milliseconds apart) each step costs several times
its warm cost, in proportion to the code and data it touches (``relayd bench
--breakdown``'s cold table). So once the general path has completed a put
or a get of a plain structure, what it derived is kept here as a *lane*,
and the next one runs as one function over what the lane holds. Between two
processes at 256 KiB (``relayd bench``, stop-and-wait) the blocking client's
put went from 57-60 to 49-55 us and its get from 46-48 to 41-45; at 4 KiB,
inline, a transfer from 97-120 to 89-93 (measured).

What a lane covers: a ``dict`` of ``str`` keys to distinct, contiguous host
tensors, in a compact DataRef, through a lease of this node's arena that
the writer fills on the caller's thread and the reader copies out, or
inline in the DataRef; no push to another node, no socket fallback, no
view, no forwarded refs, no pickle.

The contract, which the tests hold them to: a lane runs the general path's
checks on the same state (the attach, the route cache, aborted requests,
released leases, the slot header and the lease's bounds) and has its
effects (the same lease cut, notices, slot header, read mark and DataRef).
It changes nothing before it knows it can finish; when anything is not as
when it was learned, or a check fails, it returns no result (None, or
:data:`NO_LANE` for a read) and the caller takes the general path, which
raises the error (or waits for space, asks the router, re-attaches) as it
always does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _copies, _flatten, _local
from ._writer import ALIGNMENT, OFFLOAD_BYTES, PutPlan, check_count
from .wire.compact import RefView
from .wire.compact import Shape as CompactShape
from .wire.dataref import SHAPE_MEMO_BYTES, DataRef, compact_put
from .wire.names import check_request_id
from .wire.proto import relay_pb2 as pb

if TYPE_CHECKING:
    from ._aborts import AbortedRequests
    from ._checks import ReadChecks
    from ._connection import Connection
    from ._packing import TensorSpec
    from ._routes import Routes
    from ._writer import Writer
    from .wire.shm import MappedSegment

# Lanes kept per client and side; a full table starts over.
LANE_MEMORY = 64
# What ReadLanes.read returns when the general path must read: a payload may be None.
NO_LANE: Any = object()

# The router's answers a put lane is learned under: a lease of this node's arena,
# inline, or this process for a stage it no longer serves (Writer.put_here then
# puts it inline or leases it, as it fits).
_ROUTES_HERE = (pb.TRANSPORT_SHM, pb.TRANSPORT_INLINE, pb.TRANSPORT_LOCAL_OBJECT)

# What a put lane compares each tensor by: what a Shape's key holds, and the type.
_Meta = tuple[tuple[Any, ...], ...]


def _meta(tensors: list[Any]) -> _Meta:
    return tuple([(type(t), t.dtype, t.shape, t.device, t.layout, t.is_nested) for t in tensors])


class _PutLane:
    __slots__ = (
        "attach", "copies", "inline", "meta", "route", "route_key", "shape", "specs", "total",
    )  # fmt: skip

    def __init__(self, plan: PutPlan, shape: CompactShape, route: int, inline: bool) -> None:
        self.attach = plan.attach
        self.inline = inline
        self.meta = _meta(plan.tensors)
        self.route_key = plan.route_key
        self.route = route
        self.shape = shape
        self.specs = plan.specs
        self.total = plan.total
        self.copies = tuple((s.index, s.offset, s.nbytes) for s in plan.specs if s.nbytes)


class PutLanes:
    """One client's put lanes, by (to_stage, keys, whether a chunk)."""

    def __init__(
        self, conn: Connection, writer: Writer, routes: Routes, aborts: AbortedRequests
    ) -> None:
        self._conn = conn
        self._writer = writer
        self._routes = routes
        self._aborts = aborts
        self._lanes: dict[tuple[str, tuple[str, ...], bool], _PutLane] = {}

    def learn(self, plan: PutPlan, ref: DataRef) -> None:
        """Keep a lane for ``plan``'s structure, if it is one a lane covers:
        the general path has just put it as ``ref``, compact, into a lease
        or inline."""
        shape, route = plan.shape, self._routes.cached(plan.route_key)
        transport = ref.fields.transport
        if (
            plan.built is not None  # a message: pushed, or not compact
            or shape is None
            or shape.header_codec != pb.HEADER_CODEC_SAFE  # pickle=True: never for a lane's puts
            or plan.refs
            or plan.is_ref
            or plan.attach is None
            or route not in _ROUTES_HERE
            or transport not in (pb.TRANSPORT_SHM, pb.TRANSPORT_INLINE)
        ):
            return
        flat = _flatten.flat_tensors(plan.obj)
        if flat is None or not all(_copies.plain(t) for t in flat[1]):
            return
        if len(self._lanes) >= LANE_MEMORY:
            self._lanes.clear()
        inline = transport == pb.TRANSPORT_INLINE
        self._lanes[plan.to_stage, flat[0], plan.chunk_id >= 0] = _PutLane(
            plan, shape, route, inline
        )

    def put(
        self,
        attach: pb.AttachResponse,
        obj: Any,
        to_stage: str,
        request_id: str,
        chunk_id: int | None,
        pickle: bool,
        trace_id: str,
        offload_at: int | None = None,
    ) -> DataRef | None:
        """The put, through its lane; None: take the general path (nothing was done).

        ``pickle``: the caller asked for a pickled header, which no lane sends.
        ``offload_at``: copies of this many bytes or more are not the calling
        thread's to make (the async client hands them to a worker); None: any.
        """
        flat = None if pickle else _flatten.flat_tensors(obj)  # the general path's own test
        if flat is None:
            return None
        keys, tensors = flat
        lane = self._lanes.get((to_stage, keys, chunk_id is not None))
        if lane is None or lane.attach is not attach:
            return None
        total = lane.total
        if offload_at is not None and total >= offload_at:
            return None
        if not all(_copies.plain(t) for t in tensors) or _meta(tensors) != lane.meta:
            return None
        check_request_id(request_id)  # as the general path checks it, first
        chunk = -1 if chunk_id is None else check_count(chunk_id, "chunk_id")
        routes, conn, w = self._routes, self._conn, self._writer
        route = routes.cached(lane.route_key)
        if route != lane.route or (route == pb.TRANSPORT_LOCAL_OBJECT and _local.serves(to_stage)):
            return None
        if lane.inline:
            # Into the DataRef, as Writer.put_here puts it: no lease, nothing
            # for the daemon, and an abort is the reader's to see.
            data = w.inline_bytes(tensors, lane.specs, total, to_stage)
            return compact_put(lane.shape, chunk, request_id, w.object_id(), inline_data=data)
        if (
            to_stage in routes.remote_stages
            or request_id in self._aborts
            or conn.draining
            or conn.socket_fallback
        ):
            return None
        cut = w.cut_now(total, request_id, to_stage, trace_id)
        if cut is None:
            return None  # no room in the grants held: the general path waits for it
        lease, start = cut
        object_id = w.object_id()
        # A lease's generation is its id, as Writer._ref_for writes it.
        where = (lease.grant.segment, lease.slot, lease.nslots, start, total, lease.id, lease.id)
        ref = compact_put(lane.shape, chunk, request_id, object_id, where)
        try:
            with conn.lock:
                view = conn.arena(lease)[1]  # held: outlives a concurrent close
            base = view.data_ptr() + start
            if base % ALIGNMENT:  # never, for a slot: the general copy says what is wrong
                _copies.pack_at(view, start, total, tensors, lane.specs)
            else:
                for index, offset, nbytes in lane.copies:
                    _copies.memcpy(base + offset, tensors[index].data_ptr(), nbytes)
        except BaseException:
            w.cancel_lease(lease)
            raise
        w.seal_lease(lease, total, request_id, object_id, attach)
        return ref


class _ReadLane:
    __slots__ = ("specs", "tree")

    def __init__(self, tree: Any, specs: list[TensorSpec]) -> None:
        self.tree = tree
        self.specs = specs


class ReadLanes:
    """One client's read lanes, by (shape part, lease length)."""

    def __init__(
        self,
        conn: Connection,
        checks: ReadChecks,
        aborts: AbortedRequests,
        stages: tuple[str, ...],
        end_read: Callable[[RefView, MappedSegment, bool], None],
        read_inline: Callable[[RefView], tuple[list[TensorSpec], list[Any]]],
    ) -> None:
        self._conn = conn
        self._checks = checks
        self._aborts = aborts
        self._stages = stages
        # The general path's end of a copy (Reader.end_read): the seqlock's
        # second check, the read mark, the Release.
        self._end_read = end_read
        # Its copy of inline bytes (Reader._read_inline): read once per process.
        self._read_inline_bytes = read_inline
        # By (shape part, lease length), and inline ones by (shape part, bytes).
        self._lanes: dict[tuple[Any, int], _ReadLane] = {}
        self._inline: dict[tuple[Any, int], _ReadLane] = {}

    def learn(self, m: Any, tree: Any, specs: list[TensorSpec]) -> None:
        """Keep a lane for ``m``'s shape part: the general path has just copied
        ``m``'s lease or inline bytes out, its layout ``specs`` checked and
        ``tree`` its header's."""
        if (
            type(m) is not RefView
            or m.header_codec != pb.HEADER_CODEC_SAFE
            or len(m.shape.wire) > SHAPE_MEMO_BYTES  # not remembered: a new Shape each parse
            or self._checks.headers.get(m.header) is not tree  # rebuilt fresh: never shared
        ):
            return
        if m.transport == pb.TRANSPORT_INLINE:
            lanes, nbytes = self._inline, len(m.inline_data)
        elif m.transport == pb.TRANSPORT_SHM and m.lease.length < OFFLOAD_BYTES:
            lanes, nbytes = self._lanes, m.lease.length  # (a longer one is claimed first)
        else:
            return
        if len(lanes) >= LANE_MEMORY:
            lanes.clear()
        lanes[m.shape, nbytes] = _ReadLane(tree, specs)

    def read(self, ref: DataRef) -> Any:
        """``get(ref)``'s payload, a copy, through its lane; :data:`NO_LANE`: take
        the general path (nothing was read or released)."""
        m = ref.fields
        if type(m) is not RefView:
            return NO_LANE
        if m.transport == pb.TRANSPORT_INLINE:
            return self._read_inline(m)
        lease = m.lease
        lane = self._lanes.get((m.shape, lease.length))
        if lane is None or m.transport != pb.TRANSPORT_SHM:
            return NO_LANE
        conn = self._conn
        a = conn.usable()
        origin = m.origin
        if (
            a is None
            or conn.socket_fallback
            or origin.node_id != a.node_id
            or origin.daemon_epoch != a.daemon_epoch
            or m.to_stage not in self._stages
            or m.request_id in self._aborts
            or lease.lease_id in self._checks.released
        ):
            return NO_LANE
        slot, length = lease.slot, lease.length
        with conn.lock:  # the blocking client's teardown unmaps under it
            segments = conn.segments
            if not conn.attached(a) or lease.segment >= len(segments):
                return NO_LANE
            seg, view = segments[lease.segment], conn.views[lease.segment]
            if seg.misplaced(slot, lease.nslots, lease.offset, length) is not None:
                return NO_LANE
            header = seg.read_header(slot)
        if header != (lease.generation, length):
            return NO_LANE
        tensors = _copies.unpack_from(view.data_ptr() + lease.offset, lane.specs)
        self._end_read(m, seg, True)
        return _flatten.rebuild(lane.tree, tensors)

    def _read_inline(self, m: RefView) -> Any:
        """:meth:`read` of an inline DataRef: the addressee and abort checked, then
        read as the general path reads it (a second read raises there and here alike)."""
        lane = self._inline.get((m.shape, len(m.inline_data)))
        if lane is None or m.to_stage not in self._stages or m.request_id in self._aborts:
            return NO_LANE
        return _flatten.rebuild(lane.tree, self._read_inline_bytes(m)[1])
