"""DataRef: the small handle a writer gives the app to pass to the reader.

Bytes on the wire::

    b"RD" | version u8 | crc32 (u32 LE, over the body) | body

Two bodies, by the version byte:

- ``VERSION`` (1): a ``relayd.v1.DataRef``. Any put can take this form.
- ``COMPACT_VERSION`` (2): the compact form of :mod:`.compact`, a shape part
  every put of one payload structure shares, then the put's own numbers. A
  writer uses it for a plain put to a same-node or cross-node lease or inline
  when its daemon accepts it (``AttachResponse.compact_refs``); a reader
  checks each shape part once and reads the rest as plain attributes.

The checksum covers the whole encoding, so a flipped bit is refused instead
of being read as a shifted offset or a reshaped tensor. ``from_bytes`` checks
everything that does not need the daemon (framing, version, checksum, field
ranges, dtype names, the layout table against the lease length) before any
memory is touched; the reader then checks the lease's generation in shared
memory, which is what makes a stale or forged DataRef harmless.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

from google.protobuf.message import DecodeError

from . import compact
from .compact import RefFields, RefView
from .errors import CorruptRefError, VersionMismatchError
from .proto import relay_pb2 as pb
from .shm import MAX_SLOT_SIZE, SHM_POOL
from .transport import Transport

MAGIC = b"RD"
VERSION = 1
COMPACT_VERSION = 2
MAX_REF_BYTES = 4 << 20
MAX_TENSORS = 1 << 16
MAX_REFS = 4096
MAX_NAME = 256
_PREFIX = struct.Struct("<2sBI")

KIND_DATA = 0
KIND_DONE = 1
KIND_ERROR = 2

# Checked shape parts remembered, by their bytes (a stage puts a few
# structures over and over); a full memory starts over. Shape parts larger
# than SHAPE_MEMO_BYTES are checked every time, not kept.
_SHAPE_MEMORY = 256
SHAPE_MEMO_BYTES = 8192
_shapes: dict[bytes, compact.Shape] = {}


def seal(version: int, body: bytes) -> bytes:
    """``body`` framed: magic, version and its checksum."""
    return _PREFIX.pack(MAGIC, version, zlib.crc32(body)) + body


class DataRef:
    """An immutable reference to one put. Serialize with :meth:`to_bytes`."""

    __slots__ = ("_msg", "_view", "_wire")

    def __init__(self, msg: pb.DataRef, *, _wire: bytes | None = None) -> None:
        self._msg: pb.DataRef | None = msg
        self._view: RefView | None = None
        self._wire = _wire

    @classmethod
    def _compact(cls, view: RefView, wire: bytes | None) -> DataRef:
        ref = cls.__new__(cls)
        ref._msg = None
        ref._view = view
        ref._wire = wire
        return ref

    # -- wire -----------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        if self._wire is None:
            view = self._view
            if view is None:
                self._wire = self.to_v1_bytes()
            else:
                self._wire = seal(COMPACT_VERSION, compact.encode(view))
        return self._wire

    def to_v1_bytes(self) -> bytes:
        """The protobuf encoding, which every version reads: what a daemon hands
        to another node's, which may not read the compact one yet."""
        if self._wire is not None and self._wire[2] == VERSION:
            return self._wire
        return seal(VERSION, self.proto.SerializeToString(deterministic=True))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> DataRef:
        if not isinstance(data, bytes | bytearray | memoryview):
            # Like bad magic: whatever this is, it is not a DataRef (a str is
            # often one the application turned into text and forgot to decode).
            raise CorruptRefError(
                f"not a relayd DataRef: {type(data).__name__}, not the bytes of DataRef.to_bytes()"
            )
        if type(data) is not bytes:
            # Sized before the copy, in bytes (a view's len counts its items).
            with memoryview(data) as view:
                size = view.nbytes
            if size > MAX_REF_BYTES:
                raise CorruptRefError(f"DataRef of {size} bytes exceeds {MAX_REF_BYTES}")
            data = bytes(data)
        if len(data) < _PREFIX.size:
            raise CorruptRefError(f"DataRef of {len(data)} bytes is truncated")
        if len(data) > MAX_REF_BYTES:
            raise CorruptRefError(f"DataRef of {len(data)} bytes exceeds {MAX_REF_BYTES}")
        magic, version, crc = _PREFIX.unpack_from(data)
        if magic != MAGIC:
            raise CorruptRefError("not a relayd DataRef (bad magic)")
        if version != VERSION and version != COMPACT_VERSION:
            raise VersionMismatchError(
                f"DataRef format version {version}; this client reads versions "
                f"{VERSION} and {COMPACT_VERSION}"
            )
        body = data[_PREFIX.size :]
        if zlib.crc32(body) != crc:
            raise CorruptRefError("DataRef checksum mismatch: it was corrupted in transit")
        if version == COMPACT_VERSION:
            return cls._compact(_read_compact(body), data)
        msg = _parse(body)
        _validate(msg, len(body))
        return cls(msg, _wire=data)

    # -- accessors ------------------------------------------------------------------

    @property
    def proto(self) -> pb.DataRef:
        """The ``relayd.v1.DataRef`` message (built on first use from a compact one)."""
        if self._msg is None:
            assert self._view is not None
            self._msg = self._view.to_proto()
        return self._msg

    @property
    def fields(self) -> RefFields:
        """The fields a read takes, as cheaply as they come: a compact DataRef's
        plain attributes, else the message. Never mutated."""
        view = self._view
        if view is not None:
            return view
        assert self._msg is not None
        return self._msg

    @property
    def request_id(self) -> str:
        return self.fields.request_id

    @property
    def chunk_id(self) -> int | None:
        chunk = self.fields.chunk_id
        return None if chunk < 0 else chunk

    @property
    def to_stage(self) -> str:
        return self.fields.to_stage

    @property
    def from_stage(self) -> str:
        return self.fields.origin.stage

    @property
    def object_id(self) -> str:
        return self.fields.object_id

    @property
    def transport(self) -> Transport:
        return Transport.from_proto(self.fields.transport)

    @property
    def nbytes(self) -> int:
        """Tensor bytes the reference carries."""
        return sum(t.nbytes for t in self.fields.tensors)

    @property
    def kind(self) -> int:
        return self.fields.kind

    def __repr__(self) -> str:
        m = self.fields
        chunk = f", chunk={m.chunk_id}" if m.chunk_id >= 0 else ""
        return (
            f"DataRef({self.transport.value}, request={m.request_id!r}{chunk}, "
            f"to={m.to_stage!r}, bytes={self.nbytes})"
        )

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, DataRef) and self.to_bytes() == other.to_bytes()

    def __hash__(self) -> int:
        return hash(self.to_bytes())


def compact_put(
    shape: compact.Shape,
    chunk_id: int,
    request_id: str,
    object_id: str,
    lease: tuple[int, int, int, int, int, int, int] | None = None,
    inline_data: bytes = b"",
) -> DataRef:
    """A writer's compact DataRef: a put of ``shape`` in the arena lease
    ``lease`` (segment, slot, nslots, offset, length, generation, lease id),
    else inline. Encoded when first asked for its bytes; no message is built
    unless someone asks for :attr:`DataRef.proto`."""
    if lease is None:
        transport, fields = pb.TRANSPORT_INLINE, compact.NO_LEASE
    else:
        transport, fields = pb.TRANSPORT_SHM, compact.LeaseFields(SHM_POOL, *lease)
    view = RefView(shape, transport, False, chunk_id, fields, request_id, object_id, inline_data)
    return DataRef._compact(view, None)


def _parse(body: bytes) -> pb.DataRef:
    msg = pb.DataRef()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise CorruptRefError(f"DataRef does not decode: {exc}") from None
    return msg


def _read_compact(body: bytes) -> RefView:
    """A compact body's fields, checked as :func:`_validate` checks a message's."""
    shape_bytes, put, at = compact.split(body)
    shape = _shapes.get(shape_bytes)
    if shape is None:
        shape = _checked_shape(shape_bytes)
        if len(shape_bytes) <= SHAPE_MEMO_BYTES:
            if len(_shapes) >= _SHAPE_MEMORY:
                _shapes.clear()
            _shapes[shape_bytes] = shape
    (transport, flags, segment, chunk_id, slot, nslots, offset, length, generation, lease_id,
     request_len, object_len, inline_len) = put  # fmt: skip
    if transport not in compact.TRANSPORTS:
        raise CorruptRefError(f"compact DataRef names transport {transport}")
    if flags & ~compact.FLAG_PUSH:
        raise CorruptRefError(f"compact DataRef has unknown flags {flags:#x}")
    if chunk_id < -1:
        raise CorruptRefError(f"DataRef chunk_id {chunk_id} is negative")
    try:
        request_id = body[at : at + request_len].decode()
        object_id = body[at + request_len : at + request_len + object_len].decode()
    except UnicodeDecodeError:
        raise CorruptRefError("compact DataRef's ids are not UTF-8") from None
    if len(request_id) > MAX_NAME or len(object_id) > MAX_NAME:
        raise CorruptRefError(
            f"DataRef request_id or object_id is longer than {MAX_NAME} characters"
        )
    inline_data = body[len(body) - inline_len :] if inline_len else b""
    if transport == pb.TRANSPORT_SHM:
        if inline_len:
            raise CorruptRefError("compact DataRef carries inline bytes and a lease")
        lease = compact.LeaseFields(
            SHM_POOL, segment, slot, nslots, offset, length, generation, lease_id
        )
        _check_lease(lease)
    elif segment or slot or nslots or offset or length or generation or lease_id:
        raise CorruptRefError("inline DataRef names a lease")
    else:
        lease = compact.NO_LEASE
    return RefView(
        shape, transport, bool(flags), chunk_id, lease, request_id, object_id, inline_data
    )


def _checked_shape(data: bytes) -> compact.Shape:
    """A compact DataRef's shape part: the structure's fields, and nothing of one put."""
    m = _parse(data)
    if (
        m.object_id or m.request_id or m.chunk_id or m.transport or m.HasField("lease")
        or m.kind != KIND_DATA or m.inline_data or m.refs or m.cuda_event or m.message or m.push
    ):  # fmt: skip
        raise CorruptRefError("compact DataRef's shape part holds fields of one put")
    _check_structure(m, len(data))
    return compact.Shape(m, data)


def _check_structure(m: pb.DataRef, body_len: int) -> None:
    """The checks of what a payload structure fixes: version, names, header, tensor table.

    ``body_len`` is the size of the encoded message ``m`` came from (or is
    part of): no string in it is longer, so a body of at most MAX_NAME bytes
    needs no name checks (most DataRefs; five string reads, ~1.5 us).
    """
    if m.version != VERSION:
        raise VersionMismatchError(f"DataRef message version {m.version}, expected {VERSION}")
    if body_len > MAX_NAME:
        for name, value in (("to_stage", m.to_stage), ("origin.stage", m.origin.stage),
                            ("origin.node_id", m.origin.node_id)):  # fmt: skip
            if len(value) > MAX_NAME:
                raise CorruptRefError(f"DataRef {name} is longer than {MAX_NAME} characters")
    if m.kind not in (KIND_DATA, KIND_DONE, KIND_ERROR):
        raise CorruptRefError(f"DataRef kind {m.kind} is unknown")
    if len(m.tensors) > MAX_TENSORS:
        raise CorruptRefError(f"DataRef lists {len(m.tensors)} tensors (limit {MAX_TENSORS})")
    if m.header_codec not in (pb.HEADER_CODEC_SAFE, pb.HEADER_CODEC_PICKLE) and m.kind == KIND_DATA:
        raise CorruptRefError(f"DataRef header codec {m.header_codec} is unknown")
    for i, t in enumerate(m.tensors):
        if t.index != i:
            raise CorruptRefError(f"DataRef tensor table entry {i} has index {t.index}")


def _check_lease(lease: pb.LeaseRef | compact.LeaseFields) -> None:
    if lease.nslots == 0 or lease.generation == 0:
        raise CorruptRefError("DataRef lease has no slots or no generation")
    if lease.length > lease.nslots * MAX_SLOT_SIZE:
        raise CorruptRefError("DataRef lease length exceeds its slots")


def _validate(m: pb.DataRef, body_len: int) -> None:
    """Range checks that need no daemon; anything off is CorruptRefError."""
    try:
        transport = Transport.from_proto(m.transport)
    except ValueError:
        raise CorruptRefError(f"DataRef names unknown transport {m.transport}") from None
    _check_structure(m, body_len)
    if body_len > MAX_NAME:
        for name, value in (("request_id", m.request_id), ("object_id", m.object_id)):
            if len(value) > MAX_NAME:
                raise CorruptRefError(f"DataRef {name} is longer than {MAX_NAME} characters")
    if m.chunk_id < -1:
        raise CorruptRefError(f"DataRef chunk_id {m.chunk_id} is negative")
    if len(m.refs) > MAX_REFS:
        raise CorruptRefError(f"DataRef forwards {len(m.refs)} refs (limit {MAX_REFS})")
    for r in m.refs:
        # A forwarded ref is one tensor in one lease; refs do not nest.
        if (
            r.refs
            or len(r.tensors) != 1
            or r.kind != KIND_DATA
            or r.transport not in (pb.TRANSPORT_SHM, pb.TRANSPORT_SOCKET)
        ):
            raise CorruptRefError("DataRef forwards a malformed tensor reference")
        _validate(r, body_len)
    if transport in (Transport.SHM, Transport.MOONCAKE, Transport.SOCKET):
        _check_lease(m.lease)
