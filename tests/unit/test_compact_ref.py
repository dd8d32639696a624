"""The compact DataRef (format version 2): the same put as the message, and
refusal of every kind of bad input, like version 1 (see test_dataref.py)."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from relayd_client import CorruptRefError, DataRef, RelayError, Transport, VersionMismatchError
from relayd_client.wire import compact, dataref
from relayd_client.wire.compact import RefView
from relayd_client.wire.dataref import COMPACT_VERSION, MAGIC, MAX_NAME, VERSION, compact_put
from relayd_client.wire.proto import relay_pb2 as pb

LEASE = (1, 3, 2, 4096, 100, (7 << 32) + 1, (7 << 32) + 1)


def _shape(**kw: object) -> pb.DataRef:
    m = pb.DataRef(
        version=VERSION, to_stage="talker", header_codec=pb.HEADER_CODEC_SAFE, header=b"\xb1N",
        origin=pb.Origin(node_id="n", daemon_epoch="e", stage="thinker", peer_address="p:1"),
    )  # fmt: skip
    m.tensors.append(pb.TensorLayout(index=0, shape=[25], dtype="float32", offset=0, nbytes=100))
    for k, v in kw.items():
        if isinstance(v, pb.LeaseRef):
            m.lease.CopyFrom(v)
        elif isinstance(v, list):
            m.refs.extend(v)
        else:
            setattr(m, k, v)
    return m


def _put(shape: pb.DataRef, transport: int, chunk: int, inline: bytes = b"") -> pb.DataRef:
    """The message a writer fills in for the same put."""
    m = pb.DataRef()
    m.CopyFrom(shape)
    m.object_id, m.request_id, m.chunk_id = "o1", "r1", chunk
    m.transport = transport  # type: ignore[assignment]
    if transport == pb.TRANSPORT_SHM:
        segment, slot, nslots, offset, length, gen, lease_id = LEASE
        m.lease.CopyFrom(
            pb.LeaseRef(pool="shm", segment=segment, slot=slot, nslots=nslots, offset=offset,
                        length=length, generation=gen, lease_id=lease_id)
        )  # fmt: skip
    if inline:
        m.inline_data = inline
    return m


def _ref(
    shape: pb.DataRef | None = None,
    transport: int = pb.TRANSPORT_SHM,
    *,
    shape_bytes: bytes | None = None,
    push: bool = False,
    chunk_id: int = -1,
    lease: tuple[int, ...] | None = None,
    request_id: str = "r1",
    object_id: str = "o1",
    inline_data: bytes | None = None,
) -> bytes:
    """A compact DataRef's bytes, whatever the parts (encode checks nothing)."""
    shape = shape or _shape()
    if inline_data is None:
        inline_data = b"\x01" * 100 if transport == pb.TRANSPORT_INLINE else b""
    if lease is None:
        lease = LEASE if transport == pb.TRANSPORT_SHM else (0,) * 7
    part = compact.Shape(shape, shape.SerializeToString() if shape_bytes is None else shape_bytes)
    view = RefView(
        part, transport, push, chunk_id, compact.LeaseFields("shm", *lease), request_id,
        object_id, inline_data,
    )  # fmt: skip
    return dataref.seal(COMPACT_VERSION, compact.encode(view))


@pytest.mark.parametrize("transport", [pb.TRANSPORT_SHM, pb.TRANSPORT_INLINE])
@pytest.mark.parametrize("chunk", [-1, 0, 7])
def test_a_compact_ref_reads_back_as_the_same_put(transport: int, chunk: int) -> None:
    shape = _shape()
    inline = b"\x01" * 100 if transport == pb.TRANSPORT_INLINE else b""
    msg = _put(shape, transport, chunk, inline)
    lease = LEASE if transport == pb.TRANSPORT_SHM else None
    part = compact.Shape(shape, shape.SerializeToString())
    wrote = compact_put(part, chunk, "r1", "o1", lease, inline)
    assert isinstance(wrote.fields, RefView) and wrote.proto == msg
    wire = wrote.to_bytes()
    assert wire[2] == COMPACT_VERSION
    back = DataRef.from_bytes(wire)
    assert isinstance(back.fields, RefView)
    assert back.proto == msg  # every field, as a version-1 DataRef carries it
    assert back == wrote and back.to_bytes() == wire
    assert (back.request_id, back.chunk_id, back.to_stage, back.from_stage, back.nbytes) == (
        "r1", None if chunk < 0 else chunk, "talker", "thinker", 100,
    )  # fmt: skip
    assert back.transport is Transport.from_proto(transport)
    # What a daemon hands another node: version 1, the same message.
    v1 = back.to_v1_bytes()
    assert v1[2] == VERSION and DataRef.from_bytes(v1).proto == msg


def test_the_view_names_every_field_the_message_does() -> None:
    back = DataRef.from_bytes(_ref())
    view, msg = back.fields, back.proto
    assert isinstance(view, RefView)
    for name in ("version", "object_id", "request_id", "chunk_id", "transport", "to_stage",
                 "kind", "header_codec", "header", "inline_data", "cuda_event", "message",
                 "push"):  # fmt: skip
        assert getattr(view, name) == getattr(msg, name), name
    for name in ("pool", "segment", "slot", "nslots", "offset", "length", "generation",
                 "lease_id"):  # fmt: skip
        assert getattr(view.lease, name) == getattr(msg.lease, name), name
    for name in ("node_id", "daemon_epoch", "stage", "peer_address", "mooncake_session"):
        assert getattr(view.origin, name) == getattr(msg.origin, name), name
    assert list(view.tensors) == list(msg.tensors) and list(view.refs) == list(msg.refs)


def test_a_push_flag_survives_and_a_shape_part_is_checked_once() -> None:
    a = DataRef.from_bytes(_ref(push=True, request_id="a"))
    b = DataRef.from_bytes(_ref(request_id="b"))
    assert a.proto.push and not b.proto.push
    va, vb = a.fields, b.fields
    assert isinstance(va, RefView) and isinstance(vb, RefView)
    assert va.shape is vb.shape  # remembered by its bytes


def test_the_shape_memory_is_bounded() -> None:
    for i in range(dataref._SHAPE_MEMORY + 10):
        DataRef.from_bytes(_ref(_shape(to_stage=f"s{i}")))
    assert 0 < len(dataref._shapes) <= dataref._SHAPE_MEMORY


def _resealed(body: bytes) -> bytes:
    return struct.pack("<2sBI", MAGIC, COMPACT_VERSION, zlib.crc32(body)) + body


@pytest.mark.parametrize(
    ("wire", "error", "match"),
    [
        (_ref(_shape(request_id="r")), CorruptRefError, "fields of one put"),
        (_ref(_shape(chunk_id=3)), CorruptRefError, "fields of one put"),
        (_ref(_shape(transport=pb.TRANSPORT_SHM)), CorruptRefError, "fields of one put"),
        (_ref(_shape(lease=pb.LeaseRef(nslots=1))), CorruptRefError, "fields of one put"),
        (_ref(_shape(kind=1)), CorruptRefError, "fields of one put"),
        (_ref(_shape(push=True)), CorruptRefError, "fields of one put"),
        (_ref(_shape(refs=[pb.DataRef()])), CorruptRefError, "fields of one put"),
        (_ref(_shape(version=3)), VersionMismatchError, "message version"),
        (_ref(_shape(header_codec=9)), CorruptRefError, "header codec"),
        (_ref(_shape(to_stage="x" * (MAX_NAME + 1))), CorruptRefError, "longer than"),
        (_ref(shape=None, transport=pb.TRANSPORT_SOCKET), CorruptRefError, "transport 7"),
        (_ref(transport=0), CorruptRefError, "transport 0"),
        (_ref(chunk_id=-2), CorruptRefError, "negative"),
        (
            _resealed(_ref(request_id="ab")[7:].replace(b"abo1", b"\xff\xfeo1")),
            CorruptRefError,
            "UTF-8",
        ),
        (_ref(request_id="x" * (MAX_NAME + 1)), CorruptRefError, "longer than"),
        (_ref(lease=(0, 3, 0, 4096, 100, 1, 1)), CorruptRefError, "no slots"),
        (_ref(lease=(0, 3, 1, 4096, 100, 0, 1)), CorruptRefError, "no generation"),
        (_ref(lease=(0, 3, 1, 4096, (1 << 30) + 1, 1, 1)), CorruptRefError, "exceeds"),
        (_ref(inline_data=b"x"), CorruptRefError, "inline bytes and a lease"),
        (_ref(transport=pb.TRANSPORT_INLINE, lease=LEASE), CorruptRefError, "names a lease"),
        (_ref()[:-1], CorruptRefError, "checksum"),
        (_resealed(_ref()[7:] + b"x"), CorruptRefError, "add up"),
        (_resealed(_ref()[7:-1]), CorruptRefError, "add up"),
        (_resealed(b"\xff\xff\xff\x7f" + _ref()[11:]), CorruptRefError, "runs past"),
        (_resealed(b"\x00" * 10), CorruptRefError, "truncated"),
        (
            _ref(shape=None, transport=pb.TRANSPORT_SHM, shape_bytes=b"\xff" * 5),
            CorruptRefError,
            "decode",
        ),
    ],
)
def test_bad_compact_refs_are_refused_with_a_typed_error(
    wire: bytes, error: type[RelayError], match: str
) -> None:
    with pytest.raises(error, match=match):
        DataRef.from_bytes(wire)


def test_flags_this_version_does_not_know_are_refused() -> None:
    body = bytearray(_ref()[7:])
    shape_len = struct.unpack_from("<I", body)[0]
    body[4 + shape_len + 1] |= 2  # the flags byte of PUT
    with pytest.raises(CorruptRefError, match="unknown flags"):
        DataRef.from_bytes(_resealed(bytes(body)))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 4000), st.integers(1, 255), st.binary(max_size=64))
def test_any_flip_past_the_checksum_gives_only_relay_errors_or_a_sound_ref(
    pos: int, flip: int, junk: bytes
) -> None:
    body = bytearray(_ref()[7:])
    body[pos % len(body)] ^= flip
    for data in (_resealed(bytes(body)), _resealed(bytes(body) + junk), _resealed(junk)):
        try:
            ref = DataRef.from_bytes(data)
        except RelayError:
            continue
        # Whatever passes is a put version 1 would take too.
        assert DataRef.from_bytes(ref.to_v1_bytes()).proto == ref.proto


@settings(max_examples=200, deadline=None)
@given(
    chunk=st.integers(-1, 1 << 40),
    request_id=st.text(min_size=1, max_size=MAX_NAME),
    object_id=st.text(max_size=MAX_NAME),
    lease=st.tuples(
        *(st.integers(0, (1 << 32) - 1) for _ in range(5)),
        st.integers(1, 1 << 62),
        st.integers(0, 1 << 62),
    ),
    push=st.booleans(),
)
def test_any_sound_put_reads_back_as_its_message(
    chunk: int,
    request_id: str,
    object_id: str,
    lease: tuple[int, int, int, int, int, int, int],
    push: bool,
) -> None:
    segment, slot, nslots, offset, length, gen, lease_id = lease
    nslots = max(nslots, 1)
    length = min(length, nslots << 30)
    lease = (segment, slot, nslots, offset, length, gen, lease_id)
    shape = _shape()
    msg = _put(shape, pb.TRANSPORT_SHM, chunk)
    msg.request_id, msg.object_id, msg.push = request_id, object_id, push
    msg.lease.CopyFrom(
        pb.LeaseRef(pool="shm", segment=segment, slot=slot, nslots=nslots, offset=offset,
                    length=length, generation=gen, lease_id=lease_id)
    )  # fmt: skip
    wire = _ref(
        shape, chunk_id=chunk, lease=lease, request_id=request_id, object_id=object_id, push=push
    )
    assert DataRef.from_bytes(wire).proto == msg
