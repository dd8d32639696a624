"""The safe header codec: exact round trips, refusals, a decoder that only ever fails cleanly."""

from __future__ import annotations

import collections
import contextlib
import enum
import math
import struct
import tracemalloc
from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relayd_client._codec import FORMAT_MAGIC, MAX_DEPTH, encode, encode_pickle, varint
from relayd_client._codec_decode import decode, decode_pickle
from relayd_client._header_tree import RefSlot, TensorSlot
from relayd_client.wire.errors import CorruptRefError, UnsafePayloadError

# ---------------------------------------------------------------- helpers


def same(a: object, b: object) -> bool:
    """Equality that also demands equal types, dict order and float bits (-0.0, NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)  # type: ignore[arg-type]
    if isinstance(a, complex):
        assert isinstance(b, complex)
        return same(a.real, b.real) and same(a.imag, b.imag)
    if isinstance(a, list | tuple):
        assert isinstance(b, list | tuple)
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return len(a) == len(b) and all(
            same(ka, kb) and same(va, vb)
            for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
        )
    return a == b


def as_decoded(tree: object) -> object:
    """What decode(encode(tree)) must give: the same tree, bytearrays as bytes."""
    if type(tree) is bytearray:
        return bytes(tree)
    if type(tree) is list:
        return [as_decoded(x) for x in tree]
    if type(tree) is tuple:
        return tuple(as_decoded(x) for x in tree)
    if type(tree) is dict:
        return {as_decoded(k): as_decoded(v) for k, v in tree.items()}
    return tree


MAGIC = bytes((FORMAT_MAGIC,))

# ---------------------------------------------------------------- strategies

# Surrogates included: a Python str may hold them and they must survive.
texts = st.text(st.characters() | st.characters(categories=["Cs"]), max_size=80)
floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [-0.0, 0.0, math.inf, struct.unpack("<d", b"\x01\x00\x00\x00\x00\x00\xf8\x7f")[0]]
)
ints = st.integers() | st.sampled_from(
    [0, 127, 128, -1, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**63 - 1, 2**63, -(2**63),
     -(2**63) - 1, 2**200, -(2**200)]
)  # fmt: skip
hashable_scalars = st.none() | st.booleans() | ints | floats | texts | st.binary(max_size=40)
keys = st.recursive(hashable_scalars, lambda c: st.lists(c, max_size=3).map(tuple), max_leaves=6)
scalars = (
    hashable_scalars
    | st.complex_numbers(allow_nan=True, allow_infinity=True)
    | st.binary(max_size=300).map(bytearray)
    | st.integers(0, 2**40).map(TensorSlot)
    | st.integers(0, 2**40).map(RefSlot)
)
trees = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=6)
        | st.lists(children, max_size=6).map(tuple)
        | st.dictionaries(keys, children, max_size=6)
    ),
    max_leaves=40,
)

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------- round trips


@FAST
@given(trees)
def test_round_trip_keeps_values_types_and_order(tree: object) -> None:
    data = encode(tree)
    assert data[0] == FORMAT_MAGIC
    assert same(decode(data), as_decoded(tree))
    # memoryview and bytearray inputs decode the same way.
    assert same(decode(memoryview(data)), as_decoded(tree))
    assert same(decode(bytearray(data)), as_decoded(tree))


@pytest.mark.parametrize(
    "value",
    [
        None, True, False, 0, 1, 127, 128, -1, -128, 2**31, 2**63, -(2**63) - 1, 10**100,
        0.0, -0.0, 1.5, math.inf, -math.inf, 1 + 2j, complex(-0.0, math.nan),
        "", "a" * 63, "a" * 64, "é€😀", "\ud800", b"", b"\x00" * 200, [], (), {},
        [1, (1,), [1]], (True, 1, 1.0), {"b": 1, "a": 2}, {1: "int", "1": "str", (1, "x"): None},
        {None: 0, b"k": 1, 2.5: 2, False: 3}, TensorSlot(0), RefSlot(2**40), [TensorSlot(3)] * 3,
        {"x": [{"y": (TensorSlot(1), RefSlot(0))}]},
    ],
)  # fmt: skip
def test_round_trip_examples(value: object) -> None:
    assert same(decode(encode(value)), value)


def test_nan_payload_and_negative_zero_survive_bit_for_bit() -> None:
    odd_nan = struct.unpack("<d", b"\x01\x02\x03\x00\x00\x00\xf8\xff")[0]
    for x in (odd_nan, -0.0):
        out = decode(encode([x]))
        assert isinstance(out, list)
        assert struct.pack("<d", out[0]) == struct.pack("<d", x)


def test_bytearray_comes_back_as_bytes() -> None:
    assert decode(encode({"b": bytearray(b"xy")})) == {"b": b"xy"}


def test_list_tuple_and_bool_int_stay_distinct() -> None:
    out = decode(encode([[1], (1,), True, 1, False, 0]))
    assert same(out, [[1], (1,), True, 1, False, 0])


def test_small_header_is_compact() -> None:
    header = {"request_id": "r-1", "chunk": 7, "final": False, "t": TensorSlot(0)}
    text = len("request_idr-1chunkfinalt")
    # magic, dict tag + count, a length byte per str, one byte each for 7 and
    # False, tag + index for the slot.
    assert len(encode(header)) == text + 1 + 2 + 5 + 1 + 1 + 2


def test_nesting_up_to_the_limit_round_trips() -> None:
    tree: object = []
    for _ in range(MAX_DEPTH - 1):
        tree = [tree]
    assert same(decode(encode(tree)), tree)


# ---------------------------------------------------------------- refusals


class Point(NamedTuple):
    x: int


class Color(enum.IntEnum):
    RED = 1


class Custom:
    pass


class MyStr(str):
    pass


@pytest.mark.parametrize(
    ("value", "type_name"),
    [
        ({1, 2}, "set"),
        (frozenset(), "frozenset"),
        (Custom(), f"{__name__}.Custom"),
        (Point(1), f"{__name__}.Point"),
        (Color.RED, f"{__name__}.Color"),
        (collections.OrderedDict(a=1), "collections.OrderedDict"),
        (MyStr("s"), f"{__name__}.MyStr"),
        (memoryview(b"x"), "memoryview"),
        (torch.zeros(2), "torch.Tensor"),
        (print, "builtin_function_or_method"),
    ],
)
def test_unsupported_types_are_refused_with_type_and_path(value: object, type_name: str) -> None:
    with pytest.raises(UnsafePayloadError) as info:
        encode({"a": [0, 1, 2, value]})
    message = str(info.value)
    assert f"type {type_name} at path payload['a'][3]" in message
    assert "pass pickle=True" in message


def test_unsupported_dict_key_is_located() -> None:
    with pytest.raises(UnsafePayloadError, match=r"type frozenset at path payload\.keys\(\)\[1\]"):
        encode({"ok": 1, frozenset(): 2})


def test_unsupported_value_inside_tuple_key_is_located() -> None:
    with pytest.raises(UnsafePayloadError, match=r"Custom at path payload\.keys\(\)\[0\]\[1\]"):
        encode({(1, Custom()): 2})


def test_self_containing_payload_is_refused() -> None:
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(UnsafePayloadError, match="contains itself"):
        encode({"loop": loop})


def test_nesting_past_the_limit_is_refused() -> None:
    tree: object = 0
    for _ in range(MAX_DEPTH + 1):
        tree = (tree,)
    with pytest.raises(UnsafePayloadError, match=f"more than {MAX_DEPTH} containers"):
        encode(tree)


@pytest.mark.parametrize("slot", [TensorSlot(-1), RefSlot(-5), TensorSlot(1.0)])  # type: ignore[arg-type]
def test_slot_with_bad_index_is_refused(slot: object) -> None:
    with pytest.raises(UnsafePayloadError, match="must be an int >= 0"):
        encode([slot])


# ---------------------------------------------------------------- hostile input


def _decode_or_corrupt(data: bytes, **limits: int) -> None:
    with contextlib.suppress(CorruptRefError):
        decode(data, **limits)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=80), st.booleans())
def test_random_bytes_only_ever_raise_corrupt_ref(data: bytes, with_magic: bool) -> None:
    _decode_or_corrupt(MAGIC + data if with_magic else data)


@FAST
@given(trees, st.data())
def test_damaged_encodings_only_ever_raise_corrupt_ref(tree: object, data: st.DataObject) -> None:
    # One generated tree serves three damages: generating trees is the slow part.
    encoded = encode(tree)
    cut = data.draw(st.integers(0, len(encoded) - 1), label="cut")
    with pytest.raises(CorruptRefError):  # a value is self-delimiting: no prefix is valid
        decode(encoded[:cut])
    extra = data.draw(st.binary(min_size=1, max_size=8), label="extra")
    with pytest.raises(CorruptRefError, match="trailing"):
        decode(encoded + extra)
    flipped = bytearray(encoded)
    for _ in range(data.draw(st.integers(1, 3), label="flips")):
        bit = data.draw(st.integers(0, len(flipped) * 8 - 1), label="bit")
        flipped[bit // 8] ^= 1 << (bit % 8)
    _decode_or_corrupt(bytes(flipped))


def test_every_prefix_of_a_rich_header_is_refused() -> None:
    encoded = encode({"a": [1, 2.5, "x" * 70, b"y" * 130, 2**70, (None, True)], "c": 1j})
    for cut in range(len(encoded)):
        with pytest.raises(CorruptRefError):
            decode(encoded[:cut])


HUGE = 2**62
PICKLED = encode_pickle({"a": 1})


@pytest.mark.parametrize(
    "data",
    [
        MAGIC + b"s" + varint(HUGE) + b"abc",
        MAGIC + b"b" + varint(HUGE) + b"abc",
        MAGIC + b"I" + varint(HUGE) + b"abc",
        MAGIC + b"l" + varint(HUGE) + b"\x80\x80",
        MAGIC + b"t" + varint(HUGE),
        MAGIC + b"m" + varint(HUGE) + b"\x80",
        MAGIC + b"l" + varint(2**69),
    ],
)
def test_huge_declared_lengths_fail_fast_without_allocating(data: bytes) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(CorruptRefError, match="past the end"):
            decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "empty"),
        (b"\x00\x4e", "unknown format byte 0x00"),
        (PICKLED, "looks like pickle"),
        (MAGIC, "truncated"),
        (MAGIC + b"\x4e\x4e", "trailing"),
        (MAGIC + b"Z", "unknown tag 0x5a"),
        (MAGIC + b"d\x00\x00", "truncated inside a number"),
        (MAGIC + b"j" + b"\x00" * 15, "truncated inside a number"),
        (MAGIC + b"q\x00", "truncated inside a number"),
        (MAGIC + b"i\x00", "truncated inside a number"),
        (MAGIC + b"\x05abc", "runs past the end"),
        (MAGIC + b"\x02\xff\xfe", "invalid UTF-8"),
        (MAGIC + b"s\x02\xc3\x28", "invalid UTF-8"),
        (MAGIC + b"m\x01\x02\xff\xfe\x4e", "invalid UTF-8"),
        (MAGIC + b"m\x01\x01a\x02\xff\xfe", "invalid UTF-8"),
        (MAGIC + b"m\x01\x03a\x4e", "runs past the end"),
        (MAGIC + b"m\x01\x4e\x05ab", "runs past the end"),
        (MAGIC + b"m\x01l\x00\x4e", "unhashable dict key of type list"),
        (MAGIC + b"m\x01m\x00\x4e", "unhashable dict key of type dict"),
        (MAGIC + b"m\x01t\x01l\x00\x4e", "unhashable dict key of type tuple"),
        (MAGIC + b"m\x02\x01a\x4e\x01a\x54", "repeated dict key"),
        (MAGIC + b"m\x02\x81\x4e\x54\x4e", "repeated dict key"),  # 1 and True
        (MAGIC + b"S" + b"\xff" * 11, "varint longer than 10 bytes"),
        (MAGIC + b"s\x80", "truncated"),
        (MAGIC + b"l\x01", "runs past the end"),
    ],
)
def test_malformed_headers_are_refused_with_a_reason(data: bytes, match: str) -> None:
    with pytest.raises(CorruptRefError, match=match):
        decode(data)


def test_depth_limit() -> None:
    deep = MAGIC + b"l\x01" * MAX_DEPTH + b"\x4e"
    assert decode(deep) is not None
    with pytest.raises(CorruptRefError, match="nested too deeply"):
        decode(MAGIC + b"l\x01" * (MAX_DEPTH + 1) + b"\x4e")
    with pytest.raises(CorruptRefError, match="nested too deeply"):
        decode(encode([[[1]]]), max_depth=2)
    assert decode(encode([[[1]]]), max_depth=3) == [[[1]]]


def test_depth_limit_above_the_interpreter_limit_still_fails_cleanly() -> None:
    with pytest.raises(CorruptRefError):
        decode(MAGIC + b"l\x01" * 100_000 + b"\x4e", max_depth=10**6)


def test_item_limit_counts_every_container_element() -> None:
    data = encode({"a": [1, 2, 3], "b": (4,)})  # 2 keys + 2 values + 4 elements
    assert decode(data, max_items=8) == {"a": [1, 2, 3], "b": (4,)}
    with pytest.raises(CorruptRefError, match="more than 7 items"):
        decode(data, max_items=7)


def test_byte_limit_applies_before_anything_is_read() -> None:
    data = encode("x" * 100)
    with pytest.raises(CorruptRefError, match="more than the limit"):
        decode(data, max_bytes=50)
    with pytest.raises(CorruptRefError, match="more than the limit"):
        decode(memoryview(data), max_bytes=50)


@pytest.mark.parametrize("bad", ["text", 12, None])
def test_non_bytes_input_is_refused(bad: object) -> None:
    with pytest.raises(CorruptRefError, match="expected bytes"):
        decode(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- pickle opt-in


RAN: list[str] = []


def _record(note: str) -> None:
    RAN.append(note)


class _Sneaky:
    """Unpickling one calls _record: stands in for code an attacker would run."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (_record, ("code ran",))


def test_pickle_is_refused_unless_the_reader_opts_in() -> None:
    data = encode_pickle({"x": _Sneaky()})
    RAN.clear()
    with pytest.raises(UnsafePayloadError, match="opt in"):
        decode_pickle(data, False)
    assert RAN == []
    decode_pickle(data, True)
    assert RAN == ["code ran"]


def test_pickle_round_trip_with_opt_in() -> None:
    tree = {"p": Point(3), "s": {1, 2}, "t": TensorSlot(0)}
    assert decode_pickle(encode_pickle(tree), allow=True) == tree


def test_corrupt_pickle_with_opt_in_is_a_corrupt_ref() -> None:
    with pytest.raises(CorruptRefError, match="pickle failed"):
        decode_pickle(encode_pickle({"a": 1})[:-3], True)


def test_safe_decoder_refuses_pickle() -> None:
    assert PICKLED[0] == 0x80
    with pytest.raises(CorruptRefError):
        decode(PICKLED)


def test_refilled_fresh_only_when_every_list_and_dict_holds_a_placeholder() -> None:
    from relayd_client._header_tree import refilled_fresh

    t0 = TensorSlot(0)
    assert refilled_fresh({"t": t0, "n": 3, "k": (1, "a")})
    assert refilled_fresh([t0, {"r": RefSlot(0)}])
    assert refilled_fresh(t0) and refilled_fresh(7) and refilled_fresh((1, 2))
    assert not refilled_fresh({"t": t0, "meta": {"a": 1}})  # "meta" would be shared
    assert not refilled_fresh([t0, []])
    assert not refilled_fresh({"t": t0, "s": (1, [2])})  # a list inside a tuple


def test_remembered_headers_never_share_a_container_between_gets() -> None:
    import threading

    import torch
    from relayd_client._checks import ReadChecks
    from relayd_client._flatten import rebuild
    from relayd_client.wire.proto import relay_pb2 as pb

    c = ReadChecks(threading.RLock())
    for tree in (
        {"t": TensorSlot(0), "meta": {"a": [1]}},
        {"t": TensorSlot(0), "l": [TensorSlot(0)]},
    ):
        m = pb.DataRef(header_codec=pb.HEADER_CODEC_SAFE, header=encode(tree))
        first = rebuild(c.decode_header(m), [torch.ones(1)])
        second = rebuild(c.decode_header(m), [torch.ones(1)])
        for key in first:
            if isinstance(first[key], dict | list):
                assert first[key] is not second[key]
