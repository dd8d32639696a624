"""The tensor-free payload header codec.

A put's payload is split in two: tensor bytes go to shared memory (see
``_packing``), and everything else - the nesting of dicts, lists and tuples,
the plain values, and a placeholder per tensor - becomes the *header* that
travels inside the DataRef. The reader decodes that header from bytes another
process wrote, so the default codec (``HEADER_CODEC_SAFE``) can never run code
on decode: no pickle, no eval, no lookup of names that came off the wire. It
builds only the types listed below, from a closed set of tags.

Wire format (version 1)::

    header := MAGIC value
    value  := 0x80|n                       int 0..127 (one byte)
            | n                             str of n < 64 UTF-8 bytes (0x00..0x3F)
            | 'N' | 'F' | 'T'               None, False, True
            | 'i' int32 | 'q' int64         little-endian, signed
            | 'I' varint(len) bytes         any other int: signed little-endian bytes
            | 'd' float64 | 'j' 2*float64   float, complex (bit exact: -0.0 and NaN payloads)
            | 's' varint(len) utf-8         longer str (lone surrogates pass through)
            | 'b' varint(len) bytes         bytes; a bytearray is sent as bytes
            | 'l' varint(n) value*n         list
            | 't' varint(n) value*n         tuple
            | 'm' varint(n) (key value)*n   dict, insertion order kept
            | 'S' varint(i) | 'R' varint(i) TensorSlot(i), RefSlot(i)

``varint`` is unsigned LEB128. Types are matched exactly: subclasses (a
namedtuple, an IntEnum, an OrderedDict, numpy scalars) are refused with
:class:`UnsafePayloadError` rather than silently decoded as their base type.

The decoder treats its input as hostile. Every way it can fail raises
:class:`CorruptRefError`; every declared length or count is checked against
the bytes that remain before anything is allocated, and the depth, the total
number of items and the input size are bounded, so a 20-byte header cannot ask
for gigabytes.

``encode_pickle`` / ``decode_pickle`` are the ``HEADER_CODEC_PICKLE`` path for
payloads the safe codec refuses; a reader runs pickle only when it opted in.

This module holds the format (the tags and limits above) and the writer's
side; ``_codec_decode`` the reader's side, which is where the trust boundary
is; ``_header_tree`` the placeholders and the walks over a decoded tree.
"""

from __future__ import annotations

import pickle
import struct
import sys

from relayd_client._header_tree import RefSlot, TensorSlot
from relayd_client.wire.errors import UnsafePayloadError

__all__ = [
    "FORMAT_MAGIC",
    "MAX_DEPTH",
    "MAX_SHARED_HASH",
    "encode",
    "encode_pickle",
    "type_name",
    "varint",
]

# First byte of every safe header: "binary header, format 1". It is not a
# valid pickle opening (0x80), so the two codecs can never be mistaken.
FORMAT_MAGIC = 0xB1
# The encoder refuses deeper nesting (and so self-containing payloads), and it
# is the decoder's default bound, so whatever encode() writes decode() reads.
MAX_DEPTH = 64
# Keys of one dict that may share a hash. Only str and bytes hashes are
# randomized per process; a writer can pick any number of ints, floats or
# tuples with one hash (i * (2**61 - 1) for ints), and a dict of n of them
# costs n**2 / 2 comparisons to build: minutes for one 4 MiB header. Honest
# keys rarely share a hash at all (-1 and -2 do). The decoder refuses more,
# so the encoder does too: a put fails, not its reader.
MAX_SHARED_HASH = 16
_HASH_MODULUS = sys.hash_info.modulus

_NONE = 0x4E  # 'N'
_FALSE = 0x46  # 'F'
_TRUE = 0x54  # 'T'
_INT32 = 0x69  # 'i'
_INT64 = 0x71  # 'q'
_BIGINT = 0x49  # 'I'
_FLOAT = 0x64  # 'd'
_COMPLEX = 0x6A  # 'j'
_STR = 0x73  # 's'
_BYTES = 0x62  # 'b'
_LIST = 0x6C  # 'l'
_TUPLE = 0x74  # 't'
_DICT = 0x6D  # 'm'
_TSLOT = 0x53  # 'S'
_RSLOT = 0x52  # 'R'
_FIXINT = 0x80  # 0x80..0xFF: the ints 0..127
_FIXSTR_END = 0x40  # 0x00..0x3F: a str of that many UTF-8 bytes

_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
# Longest varint accepted: 10 bytes hold 70 bits, more than any real length.
# Bounding it keeps a run of continuation bytes from building a huge int.
_VARINT_MAX_BYTES = 10

# Tag and value packed in one call: on headers of ~10 scalars the number of
# bytearray operations is what the encoder's time is made of.
_pack_i32 = struct.Struct("<Bi").pack
_pack_i64 = struct.Struct("<Bq").pack
_pack_float = struct.Struct("<Bd").pack
_pack_complex = struct.Struct("<Bdd").pack

# Tag plus a one-byte length, ready-made for the common short bytes and
# containers; longer ones take :func:`_head`.
_SHORT_BYTES = [bytes((_BYTES, n)) for n in range(128)]
_SHORT_LIST = [bytes((_LIST, n)) for n in range(128)]
_SHORT_TUPLE = [bytes((_TUPLE, n)) for n in range(128)]
_SHORT_DICT = [bytes((_DICT, n)) for n in range(128)]

_SCALAR_TYPES: frozenset[type] = frozenset(
    {type(None), bool, int, float, complex, str, bytes, bytearray}
)


class _Unencodable(Exception):
    """Raised inside the encoder; encode() turns it into a message with a path."""


def varint(n: int) -> bytes:
    """``n`` (>= 0) as unsigned LEB128, the format's one way to write a length or index."""
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _head(tag: int, n: int) -> bytes:
    """``tag`` then the length, count or index ``n``."""
    return bytes((tag,)) + varint(n)


def _encode_value(obj: object, out: bytearray, depth: int) -> None:
    # Ordered by how often each type shows up in real headers. Exact type
    # checks, not isinstance: a subclass would not come back as itself.
    t = type(obj)
    if t is str:
        b = obj.encode("utf-8", "surrogatepass")  # type: ignore[attr-defined]
        n = len(b)
        if n < _FIXSTR_END:
            out.append(n)
        else:
            out += _head(_STR, n)
        out += b
    elif t is int:
        v: int = obj  # type: ignore[assignment]
        if 0 <= v < 0x80:
            out.append(_FIXINT | v)
        elif _I32_MIN <= v <= _I32_MAX:
            out += _pack_i32(_INT32, v)
        elif _I64_MIN <= v <= _I64_MAX:
            out += _pack_i64(_INT64, v)
        else:
            raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            out += _head(_BIGINT, len(raw))
            out += raw
    elif t is float:
        out += _pack_float(_FLOAT, obj)
    elif obj is None:
        out.append(_NONE)
    elif t is bool:
        out.append(_TRUE if obj else _FALSE)
    elif t is dict:
        if depth >= MAX_DEPTH:
            raise _Unencodable
        d: dict[object, object] = obj  # type: ignore[assignment]
        n = len(d)
        out += _SHORT_DICT[n] if n < 0x80 else _head(_DICT, n)
        depth += 1
        others = 0  # keys other than str: only those can share a hash too often
        for key, value in d.items():
            if type(key) is str:  # inlined: nearly every key is a short str
                b = key.encode("utf-8", "surrogatepass")
                if len(b) < _FIXSTR_END:
                    out.append(len(b))
                    out += b
                else:
                    _encode_value(key, out, depth)
            else:
                others += 1
                _encode_value(key, out, depth)
            _encode_value(value, out, depth)
        # One pass in C first: where fewer than MAX_SHARED_HASH keys repeat the
        # hash of another, none is shared by too many.
        if (
            others > MAX_SHARED_HASH
            and n - len(set(map(hash, d))) >= MAX_SHARED_HASH
            and shares_too_many(d)
        ):
            raise _Unencodable
    elif t is list or t is tuple:
        if depth >= MAX_DEPTH:
            raise _Unencodable
        seq: list[object] | tuple[object, ...] = obj  # type: ignore[assignment]
        n = len(seq)
        if n < 0x80:
            out += _SHORT_LIST[n] if t is list else _SHORT_TUPLE[n]
        else:
            out += _head(_LIST if t is list else _TUPLE, n)
        depth += 1
        for item in seq:
            _encode_value(item, out, depth)
    elif t is TensorSlot or t is RefSlot:
        index = obj.index  # type: ignore[attr-defined]
        if type(index) is not int or index < 0:
            raise _Unencodable
        out += _head(_TSLOT if t is TensorSlot else _RSLOT, index)
    elif t is bytes or t is bytearray:
        raw_b: bytes | bytearray = obj  # type: ignore[assignment]
        n = len(raw_b)
        out += _SHORT_BYTES[n] if n < 0x80 else _head(_BYTES, n)
        out += raw_b
    elif t is complex:
        c: complex = obj  # type: ignore[assignment]
        out += _pack_complex(_COMPLEX, c.real, c.imag)
    else:
        raise _Unencodable


def hash_chosen(key: object) -> bool:
    """Whether a dict key's hash is one its writer can choose, so counts
    against :data:`MAX_SHARED_HASH`: not a str or bytes (randomized per
    process), nor an int below the hash modulus (it hashes to itself, but -1)."""
    t = type(key)
    if t is int:
        return not -_HASH_MODULUS < key < _HASH_MODULUS  # type: ignore[operator]
    return t is not str and t is not bytes


def count_hash(key: object, hashes: dict[int, int]) -> bool:
    """Count ``key`` against its hash in ``hashes`` (one dict's); False once more
    than :data:`MAX_SHARED_HASH` keys share it. Raises TypeError if unhashable."""
    h = hash(key)
    shared = hashes[h] = hashes.get(h, 0) + 1
    return shared <= MAX_SHARED_HASH


def shares_too_many(d: dict[object, object]) -> bool:
    """Whether more than :data:`MAX_SHARED_HASH` keys of ``d`` share a hash its writer chose."""
    hashes: dict[int, int] = {}
    return any(hash_chosen(key) and not count_hash(key, hashes) for key in d)


def encode(tree: object) -> bytes:
    """Encode a tensor-free payload tree with the safe codec.

    Accepts None, bool, int (any size), float, complex, str, bytes, bytearray
    (decoded as bytes), list, tuple, dict (keys: any accepted hashable value,
    at most :data:`MAX_SHARED_HASH` of one hash where the writer chooses it),
    :class:`TensorSlot` and :class:`RefSlot`, nested up to :data:`MAX_DEPTH`
    containers. Anything else raises :class:`UnsafePayloadError` naming the
    type and where it sits, e.g. ``payload['a'][3]``.
    """
    out = bytearray((FORMAT_MAGIC,))
    try:
        _encode_value(tree, out, 0)
    except _Unencodable:
        raise UnsafePayloadError(_explain_failure(tree)) from None
    return bytes(out)


def type_name(t: type) -> str:
    """A type as an error message names it: builtins bare, others with their module."""
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _short_repr(obj: object) -> str:
    text = repr(obj)
    return text if len(text) <= 40 else text[:37] + "..."


def _explain_failure(tree: object) -> str:
    """Find the first value the encoder refused and say what and where.

    Only runs after a failure, so the encoder's hot path carries no paths.
    """
    found = _find_unencodable(tree, "payload", 0)
    if found is None:  # pragma: no cover - the walk mirrors _encode_value
        return "payload is not supported by the safe codec; pass pickle=True to opt in"
    return found


def _find_unencodable(obj: object, path: str, depth: int) -> str | None:
    t = type(obj)
    if t in _SCALAR_TYPES:
        return None
    if t is TensorSlot or t is RefSlot:
        index = obj.index  # type: ignore[attr-defined]
        if type(index) is not int or index < 0:
            return f"{t.__name__} at path {path} has index {index!r}; it must be an int >= 0"
        return None
    if t is dict or t is list or t is tuple:
        if depth >= MAX_DEPTH:
            return (
                f"payload nests more than {MAX_DEPTH} containers at path {path} (or contains "
                "itself), which the safe codec does not support; pass pickle=True to opt in"
            )
        if t is dict:
            d: dict[object, object] = obj  # type: ignore[assignment]
            if shares_too_many(d):
                return (
                    f"more than {MAX_SHARED_HASH} keys of the dict at path {path} share one "
                    "hash (ints, floats or tuples chosen so), which its reader would refuse "
                    "to decode; pass pickle=True to opt in"
                )
            for i, (key, value) in enumerate(d.items()):
                found = _find_unencodable(key, f"{path}.keys()[{i}]", depth + 1)
                if found is None:
                    found = _find_unencodable(value, f"{path}[{_short_repr(key)}]", depth + 1)
                if found is not None:
                    return found
        else:
            seq: list[object] | tuple[object, ...] = obj  # type: ignore[assignment]
            for i, item in enumerate(seq):
                found = _find_unencodable(item, f"{path}[{i}]", depth + 1)
                if found is not None:
                    return found
        return None
    return (
        f"type {type_name(t)} at path {path} is not supported by the safe codec; "
        "pass pickle=True to opt in"
    )


def encode_pickle(tree: object) -> bytes:
    """Encode with pickle (``HEADER_CODEC_PICKLE``), for payloads the safe codec refuses."""
    return pickle.dumps(tree, protocol=pickle.HIGHEST_PROTOCOL)
