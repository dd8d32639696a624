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
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from relayd_client.wire.errors import CorruptRefError, UnsafePayloadError

__all__ = [
    "FORMAT_MAGIC",
    "LEAVES",
    "MAX_DEPTH",
    "RefSlot",
    "TensorSlot",
    "decode",
    "decode_pickle",
    "encode",
    "encode_pickle",
]


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Placeholder for tensor number ``index`` of the DataRef's layout table."""

    index: int


@dataclass(frozen=True, slots=True)
class RefSlot:
    """Placeholder for forwarded reference number ``index``."""

    index: int


# Types that are never tensors nor hold any: walks skip them before anything
# costlier (an isinstance against torch.Tensor costs ~0.15 us a value).
LEAVES: frozenset[type] = frozenset({str, int, float, bool, type(None), bytes, complex})


def fill(
    tree: object, slot: type[TensorSlot | RefSlot], values: Sequence[object], what: str, where: str
) -> object:
    """``tree`` with ``values[i]`` wherever a ``slot`` placeholder of index ``i`` is.

    Containers holding no such placeholder are returned as they are (a decoded
    header is fresh, so nothing is shared by mistake). An index outside
    ``values`` raises :class:`CorruptRefError`: "payload header refers to
    {what} {i}, but {where} has {len(values)}".
    """
    t = type(tree)
    if t in LEAVES:
        return tree
    if t is slot:
        index: int = tree.index  # type: ignore[attr-defined]
        if not 0 <= index < len(values):
            raise CorruptRefError(
                f"payload header refers to {what} {index}, but {where} has {len(values)}"
            )
        return values[index]
    if t is dict:
        d: dict[object, object] = tree  # type: ignore[assignment]
        out: dict[object, object] = {}
        changed = False
        for key, value in d.items():
            if type(value) in LEAVES:
                out[key] = value
                continue
            new = fill(value, slot, values, what, where)
            changed = changed or new is not value
            out[key] = new
        return out if changed else tree
    if t is list or t is tuple:
        seq: list[object] | tuple[object, ...] = tree  # type: ignore[assignment]
        items = [fill(value, slot, values, what, where) for value in seq]
        if all(new is old for new, old in zip(items, seq, strict=True)):
            return tree
        return items if t is list else tuple(items)
    return tree


def refilled_fresh(tree: object) -> bool:
    """Does :func:`fill` return new containers for every list and dict of ``tree``?

    True when each of them holds a placeholder somewhere below it (tuples
    and leaves cannot be changed, so they may be shared); False for any other
    type.
    """
    try:
        _holds_slot(tree)
    except _Shared:
        return False
    return True


class _Shared(Exception):
    pass


def _holds_slot(tree: object) -> bool:
    t = type(tree)
    if t is TensorSlot or t is RefSlot:
        return True
    if t is dict:
        found = False
        for value in tree.values():  # type: ignore[attr-defined]
            found = _holds_slot(value) or found
        if not found:
            raise _Shared
        return True
    if t is list:
        if not any([_holds_slot(v) for v in tree]):  # type: ignore[attr-defined]
            raise _Shared
        return True
    if t is tuple:
        return any([_holds_slot(v) for v in tree])  # type: ignore[attr-defined]
    if t in LEAVES:
        return False
    raise _Shared  # anything else might be changed by whoever gets it


def slot_bounds(tree: object) -> tuple[int, int]:
    """How many layout entries and forwarded refs ``tree`` needs: one past the
    highest :class:`TensorSlot` and :class:`RefSlot` index in it.

    The same walk as :func:`fill`, without building anything: a reader checks
    these against the DataRef before it claims a lease, so a forged header
    consumes nothing. A negative index raises :class:`CorruptRefError`.
    """
    t = type(tree)
    if t in LEAVES:
        return 0, 0
    if t is TensorSlot or t is RefSlot:
        index: int = tree.index  # type: ignore[attr-defined]
        if index < 0:
            raise CorruptRefError(f"payload header refers to slot {index}")
        return (index + 1, 0) if t is TensorSlot else (0, index + 1)
    if t is dict:
        values: Iterable[object] = tree.values()  # type: ignore[attr-defined]
    elif t is list or t is tuple:
        values = tree  # type: ignore[assignment]
    else:
        return 0, 0
    tensors = refs = 0
    for value in values:
        if type(value) not in LEAVES:
            nt, nr = slot_bounds(value)
            tensors, refs = max(tensors, nt), max(refs, nr)
    return tensors, refs


# First byte of every safe header: "binary header, format 1". It is not a
# valid pickle opening (0x80), so the two codecs can never be mistaken.
FORMAT_MAGIC = 0xB1
# The encoder refuses deeper nesting (and so self-containing payloads), and it
# is the decoder's default bound, so whatever encode() writes decode() reads.
MAX_DEPTH = 64

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
_unpack_i32 = struct.Struct("<i").unpack_from
_unpack_i64 = struct.Struct("<q").unpack_from
_unpack_float = struct.Struct("<d").unpack_from
_unpack_complex = struct.Struct("<dd").unpack_from

# Tag plus a one-byte length, ready-made for the common short str/list/...
_SHORT_BYTES = [bytes((_BYTES, n)) for n in range(128)]
_SHORT_LIST = [bytes((_LIST, n)) for n in range(128)]
_SHORT_TUPLE = [bytes((_TUPLE, n)) for n in range(128)]
_SHORT_DICT = [bytes((_DICT, n)) for n in range(128)]

_SCALAR_TYPES: frozenset[type] = frozenset(
    {type(None), bool, int, float, complex, str, bytes, bytearray}
)


class _Unencodable(Exception):
    """Raised inside the encoder; encode() turns it into a message with a path."""


# ---------------------------------------------------------------- encode


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


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
            out.append(_STR)
            out += _varint(n)
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
            out.append(_BIGINT)
            out += _varint(len(raw))
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
        if n < 0x80:
            out += _SHORT_DICT[n]
        else:
            out.append(_DICT)
            out += _varint(n)
        depth += 1
        for key, value in d.items():
            if type(key) is str:  # inlined: nearly every key is a short str
                b = key.encode("utf-8", "surrogatepass")
                if len(b) < _FIXSTR_END:
                    out.append(len(b))
                    out += b
                else:
                    _encode_value(key, out, depth)
            else:
                _encode_value(key, out, depth)
            _encode_value(value, out, depth)
    elif t is list or t is tuple:
        if depth >= MAX_DEPTH:
            raise _Unencodable
        seq: list[object] | tuple[object, ...] = obj  # type: ignore[assignment]
        n = len(seq)
        if n < 0x80:
            out += _SHORT_LIST[n] if t is list else _SHORT_TUPLE[n]
        else:
            out.append(_LIST if t is list else _TUPLE)
            out += _varint(n)
        depth += 1
        for item in seq:
            _encode_value(item, out, depth)
    elif t is TensorSlot or t is RefSlot:
        index = obj.index  # type: ignore[attr-defined]
        if type(index) is not int or index < 0:
            raise _Unencodable
        out.append(_TSLOT if t is TensorSlot else _RSLOT)
        out += _varint(index)
    elif t is bytes or t is bytearray:
        raw_b: bytes | bytearray = obj  # type: ignore[assignment]
        n = len(raw_b)
        if n < 0x80:
            out += _SHORT_BYTES[n]
        else:
            out.append(_BYTES)
            out += _varint(n)
        out += raw_b
    elif t is complex:
        c: complex = obj  # type: ignore[assignment]
        out += _pack_complex(_COMPLEX, c.real, c.imag)
    else:
        raise _Unencodable


def encode(tree: object) -> bytes:
    """Encode a tensor-free payload tree with the safe codec.

    Accepts None, bool, int (any size), float, complex, str, bytes, bytearray
    (decoded as bytes), list, tuple, dict (keys: any accepted hashable value),
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


def _type_name(t: type) -> str:
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
        f"type {_type_name(t)} at path {path} is not supported by the safe codec; "
        "pass pickle=True to opt in"
    )


# ---------------------------------------------------------------- decode


def _corrupt(message: str) -> CorruptRefError:
    return CorruptRefError(f"payload header: {message}")


def _read_varint_tail(buf: bytes, pos: int, first: int) -> tuple[int, int]:
    """Finish a varint whose first byte (``first``, >= 0x80) was already read."""
    value = first & 0x7F
    shift = 7
    for _ in range(_VARINT_MAX_BYTES - 1):
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise _corrupt(f"varint longer than {_VARINT_MAX_BYTES} bytes at offset {pos}")


def decode(
    data: bytes | bytearray | memoryview,
    *,
    max_depth: int = MAX_DEPTH,
    max_items: int = 1_000_000,
    max_bytes: int = 64 << 20,
) -> object:
    """Decode a header written by :func:`encode`; never runs code.

    ``data`` that is not ``bytes`` is copied first, so a writer that still
    maps the same memory cannot change it half-way through the decode.

    Raises :class:`CorruptRefError` - and nothing else - when the input is
    longer than ``max_bytes``, truncated, has trailing bytes, an unknown tag
    or format byte, a length past its end, invalid UTF-8, a dict key that is
    unhashable or repeated, more than ``max_depth`` nested containers, or
    more than ``max_items`` container elements in total.
    """
    buf: bytes
    if type(data) is bytes:
        buf = data
    else:
        try:
            view = memoryview(data)
        except TypeError:
            raise _corrupt(f"expected bytes, got {_type_name(type(data))}") from None
        if view.nbytes > max_bytes:  # checked before the copy below
            raise _corrupt(f"{view.nbytes} bytes is more than the limit of {max_bytes}")
        buf = view.tobytes()
    end = len(buf)
    if end > max_bytes:
        raise _corrupt(f"{end} bytes is more than the limit of {max_bytes}")
    if end == 0:
        raise _corrupt("empty")
    if buf[0] != FORMAT_MAGIC:
        hint = " (it looks like pickle; see HEADER_CODEC_PICKLE)" if buf[0] == 0x80 else ""
        raise _corrupt(f"unknown format byte 0x{buf[0]:02x}, expected 0x{FORMAT_MAGIC:02x}{hint}")
    try:
        tree, pos = _decode_value(buf, 1, end, max_depth, [max_items, max_items])
    except IndexError:
        raise _corrupt("truncated") from None
    except struct.error:
        raise _corrupt("truncated inside a number") from None
    except UnicodeDecodeError as exc:
        # Caught here, once, so the per-str fast paths carry no handler.
        raise _corrupt(f"invalid UTF-8 in a str: {exc.reason}") from None
    except RecursionError:
        # Only reachable when a caller raises max_depth past the interpreter's
        # recursion limit.
        raise _corrupt("nested too deeply for this interpreter") from None
    if pos != end:
        raise _corrupt(f"{end - pos} trailing bytes after the value")
    return tree


def _decode_count(
    buf: bytes, pos: int, end: int, depth_left: int, per_item: int, items: list[int]
) -> tuple[int, int]:
    """Read a container's element count and charge it against the budgets.

    Checked before any element is read: each element takes at least one
    byte, so a count larger than what is left is a lie, not an allocation.
    """
    if depth_left <= 0:
        raise _corrupt(f"containers nested too deeply at offset {pos - 1}")
    n = buf[pos]
    pos += 1
    if n >= 0x80:
        n, pos = _read_varint_tail(buf, pos, n)
    if n * per_item > end - pos:
        raise _corrupt(f"container of {n} items at offset {pos} runs past the end")
    items[0] -= n * per_item
    if items[0] < 0:
        raise _corrupt(f"more than {items[1]} items")
    return n, pos


def _decode_value(
    buf: bytes, pos: int, end: int, depth_left: int, items: list[int]
) -> tuple[object, int]:
    """Decode the value at ``pos``; return it and the position after it.

    ``items`` is ``[budget left, budget]`` for container elements. A plain
    recursive function with the position in a local measured ~30% faster
    than a closure over a shared position, and flat dicts of short strs and
    small ints - the common header - are decoded inline in the dict loop.
    """
    tag = buf[pos]
    pos += 1
    if tag >= _FIXINT:
        return tag & 0x7F, pos
    if tag < _FIXSTR_END:
        if pos + tag > end:
            raise _corrupt(f"str at offset {pos - 1} runs past the end")
        return buf[pos : pos + tag].decode("utf-8", "surrogatepass"), pos + tag
    if tag == _FLOAT:
        return _unpack_float(buf, pos)[0], pos + 8
    if tag == _NONE:
        return None, pos
    if tag == _TRUE:
        return True, pos
    if tag == _FALSE:
        return False, pos
    if tag == _INT32:
        return _unpack_i32(buf, pos)[0], pos + 4
    if tag == _DICT:
        n, pos = _decode_count(buf, pos, end, depth_left, 2, items)
        depth_left -= 1
        d: dict[object, object] = {}
        for _ in range(n):
            key_pos = pos
            tag = buf[pos]
            key: object
            if tag < _FIXSTR_END:
                pos += 1 + tag
                if pos > end:
                    raise _corrupt(f"str at offset {key_pos} runs past the end")
                key = buf[key_pos + 1 : pos].decode("utf-8", "surrogatepass")
            else:
                key, pos = _decode_value(buf, pos, end, depth_left, items)
            tag = buf[pos]
            item: object
            if tag >= _FIXINT:
                item = tag & 0x7F
                pos += 1
            elif tag < _FIXSTR_END:
                start = pos + 1
                pos = start + tag
                if pos > end:
                    raise _corrupt(f"str at offset {start - 1} runs past the end")
                item = buf[start:pos].decode("utf-8", "surrogatepass")
            else:
                item, pos = _decode_value(buf, pos, end, depth_left, items)
            try:
                d[key] = item
            except TypeError:
                raise _corrupt(
                    f"unhashable dict key of type {_type_name(type(key))} at offset {key_pos}"
                ) from None
        if len(d) != n:
            raise _corrupt(f"repeated dict key in the dict ending at offset {pos}")
        return d, pos
    if tag in (_LIST, _TUPLE):
        n, pos = _decode_count(buf, pos, end, depth_left, 1, items)
        depth_left -= 1
        seq: list[object] = []
        append = seq.append
        for _ in range(n):
            item, pos = _decode_value(buf, pos, end, depth_left, items)
            append(item)
        return (seq if tag == _LIST else tuple(seq)), pos
    if tag == _STR:
        n, pos = _decode_length(buf, pos, end)
        return buf[pos : pos + n].decode("utf-8", "surrogatepass"), pos + n
    if tag == _INT64:
        return _unpack_i64(buf, pos)[0], pos + 8
    if tag == _BIGINT:
        n, pos = _decode_length(buf, pos, end)
        return int.from_bytes(buf[pos : pos + n], "little", signed=True), pos + n
    if tag == _BYTES:
        n, pos = _decode_length(buf, pos, end)
        return buf[pos : pos + n], pos + n
    if tag in (_TSLOT, _RSLOT):
        index = buf[pos]
        pos += 1
        if index >= 0x80:
            index, pos = _read_varint_tail(buf, pos, index)
        return (TensorSlot(index) if tag == _TSLOT else RefSlot(index)), pos
    if tag == _COMPLEX:
        real, imag = _unpack_complex(buf, pos)
        return complex(real, imag), pos + 16
    raise _corrupt(f"unknown tag 0x{tag:02x} at offset {pos - 1}")


def _decode_length(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """Read the byte length of a str/bytes/int body, checked against what is left."""
    n = buf[pos]
    pos += 1
    if n >= 0x80:
        n, pos = _read_varint_tail(buf, pos, n)
    if n > end - pos:
        raise _corrupt(f"length {n} at offset {pos} runs past the end")
    return n, pos


# ---------------------------------------------------------------- pickle


def encode_pickle(tree: object) -> bytes:
    """Encode with pickle (``HEADER_CODEC_PICKLE``), for payloads the safe codec refuses."""
    return pickle.dumps(tree, protocol=pickle.HIGHEST_PROTOCOL)


def decode_pickle(data: bytes | bytearray | memoryview, allow: bool) -> object:
    """Decode a pickled header - only if the reader opted in with ``allow``.

    Unpickling runs code chosen by whoever wrote ``data``; without ``allow``
    this raises :class:`UnsafePayloadError` before looking at the bytes. With
    it, any failure of the unpickler becomes :class:`CorruptRefError`.
    """
    if not allow:
        raise UnsafePayloadError(
            "the payload header was encoded with pickle, which runs code on decode; "
            "the reader must opt in to accept it"
        )
    try:
        return pickle.loads(data)
    except Exception as exc:  # the unpickler can raise anything
        raise CorruptRefError(f"payload header: pickle failed: {exc!r}") from exc
