"""DataRef wire encoding: round trip, and refusal of every kind of bad input."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from relayd_client import CorruptRefError, DataRef, RelayError, Transport, VersionMismatchError
from relayd_client.wire.dataref import MAGIC, VERSION
from relayd_client.wire.proto import relay_pb2 as pb


def _msg(**kw: object) -> pb.DataRef:
    m = pb.DataRef(
        version=VERSION, object_id="o1", request_id="r1", chunk_id=-1, to_stage="talker",
        transport=pb.TRANSPORT_SHM, header_codec=pb.HEADER_CODEC_SAFE, header=b"\xb1N",
        origin=pb.Origin(node_id="n", daemon_epoch="e", stage="thinker"),
        lease=pb.LeaseRef(pool="shm", segment=0, slot=3, nslots=2, offset=4096, length=100,
                          generation=(7 << 32) + 1, lease_id=(7 << 32) + 1),
    )  # fmt: skip
    m.tensors.append(pb.TensorLayout(index=0, shape=[25], dtype="float32", offset=0, nbytes=100))
    for k, v in kw.items():
        setattr(m, k, v)
    return m


def _wire(m: pb.DataRef, version: int = VERSION) -> bytes:
    body = m.SerializeToString()
    return struct.pack("<2sBI", MAGIC, version, zlib.crc32(body)) + body


def test_round_trip_preserves_every_field() -> None:
    ref = DataRef(_msg(chunk_id=4))
    back = DataRef.from_bytes(ref.to_bytes())
    assert back == ref and back.to_bytes() == ref.to_bytes()
    assert (back.request_id, back.chunk_id, back.to_stage, back.transport) == (
        "r1",
        4,
        "talker",
        Transport.SHM,
    )
    assert back.nbytes == 100 and back.from_stage == "thinker"


@pytest.mark.parametrize(
    ("wire", "error"),
    [
        (b"", CorruptRefError),
        (b"RD\x01", CorruptRefError),
        (b"XX" + _wire(_msg())[2:], CorruptRefError),
        (_wire(_msg(), version=3), VersionMismatchError),
        (_wire(_msg())[:-1], CorruptRefError),
        (_wire(_msg(transport=0)), CorruptRefError),
        (_wire(_msg(transport=99)), CorruptRefError),
        (_wire(_msg(chunk_id=-5)), CorruptRefError),
        (_wire(_msg(kind=9)), CorruptRefError),
        (_wire(_msg(version=3)), VersionMismatchError),
        (_wire(_msg(request_id="x" * 300)), CorruptRefError),
        (b"RD\x01" + b"\0" * 4 + b"\xff" * 10, CorruptRefError),
    ],
)
def test_bad_refs_are_refused_with_a_typed_error(wire: bytes, error: type[RelayError]) -> None:
    with pytest.raises(error):
        DataRef.from_bytes(wire)


def test_zero_generation_and_empty_lease_are_refused() -> None:
    m = _msg()
    m.lease.generation = 0
    with pytest.raises(CorruptRefError):
        DataRef.from_bytes(_wire(m))
    m = _msg()
    m.lease.nslots = 0
    with pytest.raises(CorruptRefError):
        DataRef.from_bytes(_wire(m))


def test_tensor_table_indices_must_be_dense() -> None:
    m = _msg()
    m.tensors[0].index = 3
    with pytest.raises(CorruptRefError):
        DataRef.from_bytes(_wire(m))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512), st.integers(0, 2000), st.integers(0, 255))
def test_any_bit_flip_or_garbage_gives_only_relay_errors(junk: bytes, pos: int, flip: int) -> None:
    good = bytearray(_wire(_msg()))
    good[pos % len(good)] ^= flip or 1
    for data in (bytes(good), junk, bytes(good[: pos % len(good)])):
        try:
            DataRef.from_bytes(data)
        except RelayError:
            pass


def test_remembered_layout_verdicts_never_let_a_different_layout_through() -> None:
    import threading

    from relayd_client._checks import ReadChecks

    checks = ReadChecks(threading.RLock())
    check = checks.checked_specs
    m = pb.DataRef(tensors=[pb.TensorLayout(index=0, shape=[4, 4], dtype="float32", offset=0,
                                            nbytes=64, device="cpu")])  # fmt: skip
    assert check(m, 64)[0].nbytes == 64
    assert check(m, 64)[0].shape == (4, 4)  # remembered
    assert len(checks.valid_layouts) == 1
    with pytest.raises(CorruptRefError, match="outside the region"):
        check(m, 63)  # same layout, smaller region
    m.tensors[0].offset = 4  # one field off: a new key, checked afresh
    with pytest.raises(CorruptRefError, match="outside the region"):
        check(m, 64)
    m.tensors[0].offset, m.tensors[0].nbytes = 0, 60
    with pytest.raises(CorruptRefError, match="does not match"):
        check(m, 64)
    assert len(checks.valid_layouts) == 1  # refused layouts are not remembered


@pytest.mark.parametrize("field", ["request_id", "to_stage", "object_id"])
def test_names_longer_than_the_limit_are_refused_and_the_limit_is_not(field: str) -> None:
    from relayd_client.wire.dataref import MAX_NAME

    assert DataRef.from_bytes(_wire(_msg(**{field: "x" * MAX_NAME})))
    with pytest.raises(CorruptRefError, match="longer than"):
        DataRef.from_bytes(_wire(_msg(**{field: "x" * (MAX_NAME + 1)})))
    m = _msg()
    m.origin.stage = "s" * (MAX_NAME + 1)
    with pytest.raises(CorruptRefError, match=r"origin\.stage"):
        DataRef.from_bytes(_wire(m))
