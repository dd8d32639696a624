"""The compact DataRef encoding: one payload structure's part, then one put's.

Every put of a stage's payload structure (one hidden-state tensor per chunk)
carries the same origin, addressee, header and layout table; only the ids,
the chunk and the lease differ. So a compact DataRef is::

    u32 shape_len | shape | PUT | request_id | object_id | inline_data

- ``shape``: a ``relayd.v1.DataRef`` holding only the fields a structure
  fixes (message version, to_stage, origin, header codec and bytes, tensor
  table). A writer encodes it once per structure; a reader parses and checks
  it once per structure and remembers the verdict by these bytes.
- ``PUT``: a fixed struct of the per-put numbers, then the two ids and the
  inline bytes, their lengths given in the struct.

A reader of the compact form reads plain attributes (:class:`RefView`), not
a protobuf message: after a wait, each protobuf parse and field read costs
ten times what it does back to back, and a get does dozens. The view mirrors
the message's field names, so a read path takes either (:data:`RefFields`).

This module is the layout only: :mod:`.dataref` frames it (magic, version,
checksum) and decides what a sound one is.
"""

from __future__ import annotations

import struct
from typing import TypeAlias

from .errors import CorruptRefError
from .proto import relay_pb2 as pb

_SHAPE_LEN = struct.Struct("<I")
# transport, flags, segment, chunk_id, slot, nslots, offset, length, generation,
# lease_id, len(request_id), len(object_id), len(inline_data)
PUT = struct.Struct("<BBxxIqQQQQQQHHI")
FLAG_PUSH = 1
TRANSPORTS = (pb.TRANSPORT_SHM, pb.TRANSPORT_INLINE)
"""What a compact DataRef may name; the rest keep the protobuf form."""


class LeaseFields:
    """A compact DataRef's lease, named as ``relayd.v1.LeaseRef`` names it."""

    __slots__ = ("generation", "lease_id", "length", "nslots", "offset", "pool", "segment", "slot")

    def __init__(
        self,
        pool: str,
        segment: int,
        slot: int,
        nslots: int,
        offset: int,
        length: int,
        generation: int,
        lease_id: int,
    ) -> None:
        self.pool = pool
        self.segment = segment
        self.slot = slot
        self.nslots = nslots
        self.offset = offset
        self.length = length
        self.generation = generation
        self.lease_id = lease_id

    def to_proto(self) -> pb.LeaseRef:
        return pb.LeaseRef(
            pool=self.pool, segment=self.segment, slot=self.slot, nslots=self.nslots,
            offset=self.offset, length=self.length, generation=self.generation,
            lease_id=self.lease_id,
        )  # fmt: skip


class OriginFields:
    """A structure's origin, named as ``relayd.v1.Origin`` names it."""

    __slots__ = ("daemon_epoch", "mooncake_session", "node_id", "peer_address", "stage")

    def __init__(self, o: pb.Origin) -> None:
        self.node_id = o.node_id
        self.daemon_epoch = o.daemon_epoch
        self.stage = o.stage
        self.peer_address = o.peer_address
        self.mooncake_session = o.mooncake_session


class Shape:
    """One shape part: its bytes, its message, and what a read takes from it as attributes.

    A writer makes one per payload structure, a reader one per shape part
    it checked; both share it between every put of the structure, so
    nobody mutates it.
    """

    __slots__ = (
        "header", "header_codec", "layout_key", "msg", "origin", "to_stage", "version", "wire",
    )  # fmt: skip

    def __init__(self, msg: pb.DataRef, wire: bytes) -> None:
        self.msg = msg
        self.wire = wire
        self.version = msg.version
        self.to_stage = msg.to_stage
        self.origin = OriginFields(msg.origin)
        self.header_codec = msg.header_codec
        self.header = msg.header
        # What ReadChecks.checked_specs keys a layout verdict on.
        self.layout_key = tuple([t.SerializeToString() for t in msg.tensors])


class RefView:
    """A compact DataRef's fields, named as ``relayd.v1.DataRef`` names them."""

    __slots__ = (
        "chunk_id", "header", "header_codec", "inline_data", "layout_key", "lease", "object_id",
        "origin", "push", "request_id", "shape", "tensors", "to_stage", "transport", "version",
    )  # fmt: skip

    # Never set in a compact DataRef (see dataref._compact_fits).
    kind = 0
    refs: tuple[pb.DataRef, ...] = ()
    cuda_event = b""
    message = ""

    def __init__(
        self,
        shape: Shape,
        transport: int,
        push: bool,
        chunk_id: int,
        lease: LeaseFields,
        request_id: str,
        object_id: str,
        inline_data: bytes,
    ) -> None:
        self.shape = shape
        self.version = shape.version
        self.to_stage = shape.to_stage
        self.origin = shape.origin
        self.header_codec = shape.header_codec
        self.header = shape.header
        self.tensors = shape.msg.tensors  # read only: the shape is shared
        self.layout_key = shape.layout_key
        self.transport = transport
        self.push = push
        self.chunk_id = chunk_id
        self.lease = lease
        self.request_id = request_id
        self.object_id = object_id
        self.inline_data = inline_data

    def to_proto(self) -> pb.DataRef:
        """The ``relayd.v1.DataRef`` a protobuf DataRef of the same put would hold."""
        m = pb.DataRef()
        m.CopyFrom(self.shape.msg)
        m.object_id = self.object_id
        m.request_id = self.request_id
        m.chunk_id = self.chunk_id
        m.transport = self.transport  # type: ignore[assignment]
        if self.transport == pb.TRANSPORT_SHM:
            m.lease.CopyFrom(self.lease.to_proto())
        if self.inline_data:
            m.inline_data = self.inline_data
        if self.push:
            m.push = True
        return m


RefFields: TypeAlias = "pb.DataRef | RefView"
"""A DataRef's fields as a read path reads them: either form."""

NO_LEASE = LeaseFields("", 0, 0, 0, 0, 0, 0, 0)


def encode(v: RefView) -> bytes:
    """The compact body (unframed) of the put ``v`` holds."""
    lease = v.lease
    request_id, object_id = v.request_id.encode(), v.object_id.encode()
    put = PUT.pack(
        v.transport, FLAG_PUSH if v.push else 0, lease.segment, v.chunk_id, lease.slot,
        lease.nslots, lease.offset, lease.length, lease.generation, lease.lease_id,
        len(request_id), len(object_id), len(v.inline_data),
    )  # fmt: skip
    shape = v.shape.wire
    return b"".join((_SHAPE_LEN.pack(len(shape)), shape, put, request_id, object_id, v.inline_data))


def split(body: bytes) -> tuple[bytes, tuple[int, ...], int]:
    """The shape bytes, the PUT numbers and where the ids start; CorruptRefError
    when the lengths do not add up to exactly ``body``."""
    if len(body) < _SHAPE_LEN.size + PUT.size:
        raise CorruptRefError(f"compact DataRef of {len(body)} bytes is truncated")
    (shape_len,) = _SHAPE_LEN.unpack_from(body)
    at = _SHAPE_LEN.size + shape_len
    if at + PUT.size > len(body):
        raise CorruptRefError("compact DataRef's shape part runs past its end")
    put = PUT.unpack_from(body, at)
    at += PUT.size
    if at + put[-3] + put[-2] + put[-1] != len(body):
        raise CorruptRefError("compact DataRef's lengths do not add up to its size")
    return body[_SHAPE_LEN.size : _SHAPE_LEN.size + shape_len], put, at
