"""Property-based fuzzing of the DataRef decoder and the reader's daemon-free checks.

Mutations re-seal the checksum, so they get past the CRC and exercise field
validation: inconsistent layout tables, shape x dtype != bytes, overlapping
tensors, offsets past the lease, negative and enormous sizes, forged
generations, unicode and oversized names. Every case must end in a
RelayError subclass; a case that passes must describe tensors that lie inside
the lease.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relayd_client import DataRef, RelayError
from relayd_client._checks import layout_specs as _specs
from relayd_client._codec import encode
from relayd_client._codec_decode import decode, decode_pickle
from relayd_client._packing import dtype_from_name, validate_layout
from relayd_client.wire.dataref import MAGIC, MAX_REF_BYTES, VERSION
from relayd_client.wire.proto import relay_pb2 as pb

from tests._figures import count

pytestmark = pytest.mark.timeout(300)

SETTINGS = settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
DTYPES = ["float32", "bfloat16", "uint8", "int64", "bool", "float64", "complex64"]


def seal(body: bytes, version: int = VERSION) -> bytes:
    return struct.pack("<2sBI", MAGIC, version, zlib.crc32(body)) + body


def good_msg() -> pb.DataRef:
    m = pb.DataRef(
        version=VERSION,
        object_id="0" * 32,
        request_id="r1",
        chunk_id=-1,
        transport=pb.TRANSPORT_SHM,
        to_stage="talker",
        header_codec=pb.HEADER_CODEC_SAFE,
        header=encode({"a": 1}),
        origin=pb.Origin(node_id="n", daemon_epoch="e", stage="thinker"),
        lease=pb.LeaseRef(
            pool="shm", segment=0, slot=4, nslots=2, offset=4096 + 4 * 65536, length=100_000,
            generation=(3 << 32) | 1, lease_id=(3 << 32) | 1,
        ),
    )  # fmt: skip
    m.tensors.append(
        pb.TensorLayout(index=0, shape=[10, 10], dtype="float32", offset=0, nbytes=400)
    )
    m.tensors.append(pb.TensorLayout(index=1, shape=[3], dtype="int64", offset=448, nbytes=24))
    return m


def check_decoded(ref: DataRef) -> None:
    """What a reader checks before touching memory; a pass must be a sound layout."""
    m = ref.proto
    if m.header_codec == pb.HEADER_CODEC_PICKLE:
        decode_pickle(m.header, False)  # must refuse: nobody opted in
        raise AssertionError("a pickle header was decoded without opt-in")
    decode(m.header)
    specs = _specs(m)
    region = m.lease.length if m.transport != pb.TRANSPORT_INLINE else len(m.inline_data)
    validate_layout(specs, region)
    spans = []
    for s in specs:
        itemsize = torch.empty(0, dtype=dtype_from_name(s.dtype)).element_size()
        assert s.nbytes == math.prod(s.shape) * itemsize
        assert s.offset >= 0 and s.offset + s.nbytes <= region
        if s.nbytes:
            spans.append((s.offset, s.offset + s.nbytes))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


def only_relay_errors(wire: bytes) -> str:
    count("bad DataRef inputs tried")
    try:
        ref = DataRef.from_bytes(wire)
        check_decoded(ref)
    except RelayError as exc:
        return type(exc).__name__
    return "accepted"


u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
u32 = st.integers(0, 2**32 - 1)
sizes = st.one_of(st.integers(0, 1 << 20), u64, st.sampled_from([0, 1, 2**63, 2**64 - 1]))
names = st.one_of(st.text(max_size=40), st.text(min_size=250, max_size=2000), st.just("a" * 300))
layouts = st.lists(
    st.fixed_dictionaries(
        {
            "index": st.one_of(st.integers(0, 3), u32),
            "shape": st.lists(st.one_of(st.integers(-3, 20), i64), max_size=5),
            "dtype": st.one_of(st.sampled_from(DTYPES), st.text(max_size=12)),
            "offset": st.one_of(st.integers(0, 200_000).map(lambda x: x - x % 8), sizes),
            "nbytes": st.one_of(st.integers(0, 200_000), sizes),
        }
    ),
    max_size=6,
)


@st.composite
def forged(draw: Any) -> bytes:
    m = good_msg()
    if draw(st.booleans()):
        del m.tensors[:]
        for t in draw(layouts):
            m.tensors.append(pb.TensorLayout(**t, device="cpu"))
    lease = m.lease
    for field, strat in (("segment", u32), ("slot", u64), ("nslots", u64), ("offset", u64),
                         ("length", sizes), ("generation", u64), ("lease_id", u64)):  # fmt: skip
        if draw(st.integers(0, 3)) == 0:
            setattr(lease, field, draw(strat))
    if draw(st.integers(0, 4)) == 0:
        m.request_id = draw(names)
    if draw(st.integers(0, 4)) == 0:
        m.to_stage = draw(names)
    if draw(st.integers(0, 4)) == 0:
        m.origin.stage = draw(names)
    if draw(st.integers(0, 5)) == 0:
        m.version = draw(u32)
    if draw(st.integers(0, 5)) == 0:
        m.transport = draw(st.integers(0, 9))
    if draw(st.integers(0, 5)) == 0:
        m.chunk_id = draw(i64)
    if draw(st.integers(0, 5)) == 0:
        m.kind = draw(st.integers(0, 5))
    if draw(st.integers(0, 4)) == 0:
        m.header_codec = draw(st.integers(0, 4))
    if draw(st.integers(0, 3)) == 0:
        m.header = draw(st.binary(max_size=200))
    if draw(st.integers(0, 5)) == 0:
        m.inline_data = draw(st.binary(max_size=600))
    return seal(m.SerializeToString())


@SETTINGS
@given(forged())
def test_forged_fields_with_a_valid_checksum_give_only_relay_errors(wire: bytes) -> None:
    only_relay_errors(wire)


@SETTINGS
@given(st.data())
def test_bit_flips_with_the_checksum_recomputed_give_only_relay_errors(data: Any) -> None:
    body = bytearray(good_msg().SerializeToString())
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, len(body) - 1))
        body[pos] ^= 1 << data.draw(st.integers(0, 7))
    only_relay_errors(seal(bytes(body)))


@SETTINGS
@given(st.data())
def test_truncated_random_and_wrong_version_refs_give_only_relay_errors(data: Any) -> None:
    body = good_msg().SerializeToString()
    k = data.draw(st.integers(0, len(body)))
    assert only_relay_errors(seal(body[:k])) != "crash"
    assert only_relay_errors(seal(body, data.draw(st.integers(0, 255)))) != "crash"
    assert only_relay_errors(data.draw(st.binary(max_size=400))) != "accepted"
    assert only_relay_errors(seal(data.draw(st.binary(max_size=400)))) != "crash"


def test_oversized_ref_is_refused_before_parsing() -> None:
    assert only_relay_errors(seal(b"\x00" * (MAX_REF_BYTES + 1))) == "CorruptRefError"
