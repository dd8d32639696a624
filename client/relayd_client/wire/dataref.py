"""DataRef: the small handle a writer gives the app to pass to the reader.

Bytes on the wire::

    b"RD" | version u8 | crc32 (u32 LE, over the protobuf body) | relayd.v1.DataRef

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

from .errors import CorruptRefError, VersionMismatchError
from .proto import relay_pb2 as pb
from .transport import Transport

MAGIC = b"RD"
VERSION = 1
MAX_REF_BYTES = 4 << 20
MAX_TENSORS = 1 << 16
MAX_REFS = 4096
MAX_NAME = 256
_PREFIX = struct.Struct("<2sBI")

KIND_DATA = 0
KIND_DONE = 1
KIND_ERROR = 2


class DataRef:
    """An immutable reference to one put. Serialize with :meth:`to_bytes`."""

    __slots__ = ("_msg", "_wire")

    def __init__(self, msg: pb.DataRef, *, _wire: bytes | None = None) -> None:
        self._msg = msg
        self._wire = _wire

    # -- wire -----------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        if self._wire is None:
            body = self._msg.SerializeToString(deterministic=True)
            self._wire = _PREFIX.pack(MAGIC, VERSION, zlib.crc32(body)) + body
        return self._wire

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> DataRef:
        if not isinstance(data, bytes | bytearray | memoryview):
            # Like bad magic: whatever this is, it is not a DataRef (a str is
            # often one the application turned into text and forgot to decode).
            raise CorruptRefError(
                f"not a relayd DataRef: {type(data).__name__}, not the bytes of DataRef.to_bytes()"
            )
        data = bytes(data)
        if len(data) < _PREFIX.size:
            raise CorruptRefError(f"DataRef of {len(data)} bytes is truncated")
        if len(data) > MAX_REF_BYTES:
            raise CorruptRefError(f"DataRef of {len(data)} bytes exceeds {MAX_REF_BYTES}")
        magic, version, crc = _PREFIX.unpack_from(data)
        if magic != MAGIC:
            raise CorruptRefError("not a relayd DataRef (bad magic)")
        if version != VERSION:
            raise VersionMismatchError(
                f"DataRef format version {version}; this client reads version {VERSION}"
            )
        body = data[_PREFIX.size :]
        if zlib.crc32(body) != crc:
            raise CorruptRefError("DataRef checksum mismatch: it was corrupted in transit")
        msg = pb.DataRef()
        try:
            msg.ParseFromString(body)
        except DecodeError as exc:
            raise CorruptRefError(f"DataRef does not decode: {exc}") from None
        _validate(msg, len(body))
        return cls(msg, _wire=data)

    # -- accessors ------------------------------------------------------------------

    @property
    def proto(self) -> pb.DataRef:
        return self._msg

    @property
    def request_id(self) -> str:
        return self._msg.request_id

    @property
    def chunk_id(self) -> int | None:
        return None if self._msg.chunk_id < 0 else self._msg.chunk_id

    @property
    def to_stage(self) -> str:
        return self._msg.to_stage

    @property
    def from_stage(self) -> str:
        return self._msg.origin.stage

    @property
    def object_id(self) -> str:
        return self._msg.object_id

    @property
    def transport(self) -> Transport:
        return Transport.from_proto(self._msg.transport)

    @property
    def nbytes(self) -> int:
        """Tensor bytes the reference carries."""
        return sum(t.nbytes for t in self._msg.tensors)

    @property
    def kind(self) -> int:
        return self._msg.kind

    def __repr__(self) -> str:
        m = self._msg
        chunk = f", chunk={m.chunk_id}" if m.chunk_id >= 0 else ""
        return (
            f"DataRef({self.transport.value}, request={m.request_id!r}{chunk}, "
            f"to={m.to_stage!r}, bytes={self.nbytes})"
        )

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, DataRef) and self.to_bytes() == other.to_bytes()

    def __hash__(self) -> int:
        return hash(self.to_bytes())


def _validate(m: pb.DataRef, body_len: int) -> None:
    """Range checks that need no daemon; anything off is CorruptRefError.

    ``body_len`` is the size of the encoded message ``m`` came from (or is
    part of): no string in it is longer, so a body of at most MAX_NAME bytes
    needs no name checks (most DataRefs; five string reads, ~1.5 us).
    """
    try:
        transport = Transport.from_proto(m.transport)
    except ValueError:
        raise CorruptRefError(f"DataRef names unknown transport {m.transport}") from None
    if m.version != VERSION:
        raise VersionMismatchError(f"DataRef message version {m.version}, expected {VERSION}")
    if body_len > MAX_NAME:
        for name, value in (("request_id", m.request_id), ("to_stage", m.to_stage),
                            ("object_id", m.object_id), ("origin.stage", m.origin.stage),
                            ("origin.node_id", m.origin.node_id)):  # fmt: skip
            if len(value) > MAX_NAME:
                raise CorruptRefError(f"DataRef {name} is longer than {MAX_NAME} characters")
    if m.chunk_id < -1:
        raise CorruptRefError(f"DataRef chunk_id {m.chunk_id} is negative")
    if m.kind not in (KIND_DATA, KIND_DONE, KIND_ERROR):
        raise CorruptRefError(f"DataRef kind {m.kind} is unknown")
    if len(m.tensors) > MAX_TENSORS:
        raise CorruptRefError(f"DataRef lists {len(m.tensors)} tensors (limit {MAX_TENSORS})")
    if m.header_codec not in (pb.HEADER_CODEC_SAFE, pb.HEADER_CODEC_PICKLE) and m.kind == KIND_DATA:
        raise CorruptRefError(f"DataRef header codec {m.header_codec} is unknown")
    for i, t in enumerate(m.tensors):
        if t.index != i:
            raise CorruptRefError(f"DataRef tensor table entry {i} has index {t.index}")
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
        lease = m.lease
        if lease.nslots == 0 or lease.generation == 0:
            raise CorruptRefError("DataRef lease has no slots or no generation")
        if lease.length > lease.nslots * (1 << 30):
            raise CorruptRefError("DataRef lease length exceeds its slots")
