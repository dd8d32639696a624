"""Dict keys that share one hash value: a header decode bomb that costs time, not memory.

Python does not randomize the hash of ints, floats, complexes, tuples or the
slot placeholders, so a writer can choose thousands of distinct keys with one
hash (``i * (2**61 - 1)`` for ints). Building a dict of ``n`` of them costs
``n**2 / 2`` key comparisons: a 4 MiB DataRef header of them would hold a
reader's get (and its event loop) for minutes. The decoder refuses a dict in
which too many keys share a hash, whatever else it holds; the encoder refuses
to write one, so that a writer learns it at put and not its reader at get.
"""

from __future__ import annotations

import threading

import pytest
from relayd_client._checks import ReadChecks
from relayd_client._codec import FORMAT_MAGIC, encode, varint
from relayd_client._codec_decode import MAX_SHARED_HASH, decode
from relayd_client._header_tree import TensorSlot
from relayd_client.wire.errors import CorruptRefError, UnsafePayloadError
from relayd_client.wire.proto import relay_pb2 as pb

_P = (1 << 61) - 1  # hash(i * _P) == 0 for every int i


def _colliding_ints(n: int) -> list[int]:
    keys = [i * _P for i in range(1, n + 1)]
    assert len({hash(k) for k in keys}) == 1
    return keys


def _colliding_slots(n: int) -> list[TensorSlot]:
    # hash(TensorSlot(i)) == hash((i,)), which depends on i only through hash(i).
    keys = [TensorSlot(i * _P) for i in range(1, n + 1)]
    assert len({hash(k) for k in keys}) == 1
    return keys


def _dict_header(keys: list[object]) -> bytes:
    """A header of one dict ``{key: None}``, encoded by hand (no dict is built here)."""
    body = bytearray((FORMAT_MAGIC, 0x6D)) + varint(len(keys))
    for key in keys:
        body += encode(key)[1:] + b"N"
    return bytes(body)


@pytest.mark.parametrize("make_keys", [_colliding_ints, _colliding_slots])
def test_a_dict_of_keys_with_one_hash_is_refused(make_keys: object) -> None:
    header = _dict_header(make_keys(2000))  # type: ignore[operator]
    with pytest.raises(CorruptRefError, match="share one hash"):
        decode(header)


def test_the_refusal_holds_inside_nested_containers_and_with_other_keys() -> None:
    keys: list[object] = ["a", 1, 2.5, *_colliding_ints(MAX_SHARED_HASH + 1)]
    header = bytes((FORMAT_MAGIC,)) + b"l\x01" + _dict_header(keys)[1:]
    with pytest.raises(CorruptRefError, match="share one hash"):
        decode(header)


def test_a_reader_refuses_such_a_header_before_it_looks_at_the_layout() -> None:
    m = pb.DataRef(
        version=1, to_stage="t", header_codec=pb.HEADER_CODEC_SAFE,
        header=_dict_header(_colliding_ints(2000)),
    )  # fmt: skip
    with pytest.raises(CorruptRefError, match="share one hash"):
        ReadChecks(threading.RLock()).decode_header(m)


def test_keys_up_to_the_limit_of_one_hash_and_honest_int_keys_still_round_trip() -> None:
    shared = {k: i for i, k in enumerate(_colliding_ints(MAX_SHARED_HASH))}
    assert decode(encode(shared)) == shared
    # hash(-1) == hash(-2): the collision an honest payload may meet.
    assert decode(encode({-1: "a", -2: "b"})) == {-1: "a", -2: "b"}
    many = {i * 7919: (i, float(i)) for i in range(5000)}
    many.update({(i, -i): TensorSlot(i) for i in range(5000)})
    assert decode(encode(many)) == many


_FLOATS = [2.0 ** (61 * k) for k in range(MAX_SHARED_HASH + 1)]  # all hash to 1, as 1 does


@pytest.mark.parametrize(
    "keys",
    [
        pytest.param(_colliding_ints(MAX_SHARED_HASH), id="ints-at-the-limit"),
        pytest.param(_colliding_ints(MAX_SHARED_HASH + 1), id="ints-over"),
        pytest.param(_colliding_slots(MAX_SHARED_HASH + 1), id="slots-over"),
        pytest.param([(i * _P,) for i in range(MAX_SHARED_HASH + 1)], id="tuples-over"),
        pytest.param(_FLOATS, id="floats-over"),
        # 0 and 1 hash as the others do but are below the modulus: neither side counts them.
        pytest.param([0, *_colliding_ints(MAX_SHARED_HASH)], id="ints-and-0"),
        pytest.param([1, *_FLOATS[1:]], id="floats-and-1"),
        pytest.param([-_P, *_colliding_ints(MAX_SHARED_HASH)], id="ints-and-minus-modulus"),
        pytest.param([True, *_FLOATS[1:]], id="floats-and-True"),
    ],
)
def test_the_encoder_refuses_exactly_the_dicts_the_decoder_refuses(keys: list[object]) -> None:
    """A writer learns at put what its reader would refuse; nothing the reader takes is refused."""
    assert len(set(keys)) == len(keys)
    header = _dict_header(keys)
    try:
        decode(header)
    except CorruptRefError:
        with pytest.raises(UnsafePayloadError, match="share one hash") as err:
            encode([{"ok": 1}, dict.fromkeys(keys)])
        assert "payload[1]" in str(err.value) and "pickle=True" in str(err.value)
    else:
        assert encode(dict.fromkeys(keys)) == header
