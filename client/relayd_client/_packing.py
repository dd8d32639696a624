"""Payload packing: a nested payload to (header tree, tensors, layout) and back.

Writer side::

    tree, tensors = flatten(payload)          # tensors become TensorSlot(i)
    specs, total = plan_layout(tensors)       # where each tensor's bytes go
    pack_into(region, tensors, specs)         # one copy per tensor, into shared memory

Reader side::

    validate_layout(specs, len(region))       # the specs came off the wire
    tensors = unpack(region, specs, copy=True)
    payload = rebuild(tree, tensors)

Offsets in a :class:`TensorSpec` are byte offsets from the start of the
region (the lease's data, or the DataRef's inline data). Each tensor starts
at a multiple of ``max(alignment, itemsize)``: the region itself starts on a
slot boundary, and copies into 64-byte-aligned destinations were measured up
to 1.8x faster than misaligned ones.

Only exact ``dict``, ``list`` and ``tuple`` containers are searched for
tensors, the same containers the safe header codec accepts; a tensor inside
anything else (a namedtuple, a dataclass) stays where it is, and the safe
codec then refuses that container.
"""

from __future__ import annotations

import ctypes
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from relayd_client._codec import LEAVES as _LEAVES
from relayd_client._codec import MAX_DEPTH, RefSlot, TensorSlot, fill
from relayd_client._refs import TensorRef
from relayd_client.wire.errors import CorruptRefError, InvalidArgumentError, UnsafePayloadError

__all__ = [
    "TensorSpec",
    "dtype_from_name",
    "dtype_name",
    "flatten",
    "pack_into",
    "payload_nbytes",
    "plan_layout",
    "rebuild",
    "unpack",
    "validate_layout",
]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Where tensor ``index`` lives in a region; mirrors ``relayd.v1.TensorLayout``.

    ``dtype`` is the torch name without ``torch.`` (``"bfloat16"``). ``device``
    is where the writer's tensor was (``"cpu"``, ``"cuda:<n>"``; the client
    may replace the ordinal by the GPU's UUID); it is informational - the
    bytes in the region are always host-addressable.
    """

    index: int
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int
    device: str


# Every dtype whose tensors are plain fixed-size elements that copy_ moves
# bit for bit, by name. Quantized dtypes are left out (a scale and zero
# point live outside the bytes), and so are the sub-byte int1..7/uint1..7
# placeholders (no copy kernel). Newer names are taken only if this torch
# has them.
_DTYPE_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "complex32",
    "complex64",
    "complex128",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "bits8",
    "bits16",
)
_DTYPES: dict[str, torch.dtype] = {
    name: dt for name in _DTYPE_NAMES if isinstance(dt := getattr(torch, name, None), torch.dtype)
}
_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in _DTYPES.items()}
_ITEMSIZE: dict[str, int] = {name: dt.itemsize for name, dt in _DTYPES.items()}
_COMPLEX32 = _DTYPES.get("complex32")

# Bounds on what a spec from the wire may describe before torch sees it:
# torch computes strides in int64, and an empty tensor of shape (0, 2**62,
# 2**62) overflows them, so the product of the dims (zeros counted as 1)
# must stay in range even when no byte is involved.
_MAX_NDIM = 64
_MAX_ELEMENTS = (1 << 62) - 1


def dtype_name(dt: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; InvalidArgumentError for dtypes relayd can't carry."""
    try:
        return _NAMES[dt]
    except KeyError:
        raise InvalidArgumentError(
            f"tensors of dtype {dt} cannot be relayed (supported: {', '.join(_DTYPES)})"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``, from the whitelist only; else CorruptRefError."""
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise CorruptRefError(f"tensor layout: unknown dtype {name!r}") from None


# ---------------------------------------------------------------- flatten / rebuild


def flatten(obj: object, refs: list[Any] | None = None) -> tuple[object, list[torch.Tensor]]:
    """Replace every tensor in ``obj`` by a :class:`TensorSlot`, in depth-first order.

    With a ``refs`` list, every forwarded :class:`~relayd_client._refs.TensorRef`
    is replaced by a :class:`RefSlot` and appended to ``refs`` (deduplicated by
    identity, like tensors); without one a TensorRef stays in the tree and the
    header codec refuses it.

    The same tensor object reached twice gets one slot (deduplicated by
    identity), so it is sent once and the reader gets one tensor back in
    both places, as the writer had. Distinct tensors that share storage
    (views of each other) are separate slots.

    Containers without tensors are returned as they are, not copied. A
    tensor used as (or inside) a dict key raises :class:`UnsafePayloadError`.
    """
    tensors: list[torch.Tensor] = []
    slots: dict[int, TensorSlot | RefSlot] = {}
    return _flatten(obj, tensors, slots, None, 0, refs), tensors


# A path is a chain of (parent, key) pairs, built as the walk descends and
# only turned into text for an error message.
_Path = tuple[object, object] | None


def _path_text(path: _Path) -> str:
    keys: list[object] = []
    while path is not None:
        parent, key = path
        keys.append(key)
        path = parent  # type: ignore[assignment]
    return "payload" + "".join(f"[{key!r}]" for key in reversed(keys))


def _flatten(
    obj: object,
    tensors: list[torch.Tensor],
    slots: dict[int, TensorSlot | RefSlot],
    path: _Path,
    depth: int,
    refs: list[Any] | None,
) -> object:
    t = type(obj)
    if t in _LEAVES:
        return obj
    if t is dict:
        if depth >= MAX_DEPTH:
            raise _too_deep(path)
        d: dict[object, object] = obj  # type: ignore[assignment]
        out: dict[object, object] = {}
        changed = False
        for key, value in d.items():
            if type(key) is not str and _has_tensor(key):
                raise UnsafePayloadError(
                    f"a tensor is used as a dict key in {_path_text(path)}; "
                    "tensors can only be values"
                )
            if type(value) in _LEAVES:  # skip the call for the common plain values
                out[key] = value
                continue
            new = _flatten(value, tensors, slots, (path, key), depth + 1, refs)
            changed = changed or new is not value
            out[key] = new
        return out if changed else obj
    if t is list or t is tuple:
        if depth >= MAX_DEPTH:
            raise _too_deep(path)
        seq: list[object] | tuple[object, ...] = obj  # type: ignore[assignment]
        items = [
            _flatten(value, tensors, slots, (path, i), depth + 1, refs)
            for i, value in enumerate(seq)
        ]
        if all(new is old for new, old in zip(items, seq, strict=True)):
            return obj
        return items if t is list else tuple(items)
    if isinstance(obj, torch.Tensor):
        slot = slots.get(id(obj))
        if slot is None:
            # The payload keeps obj alive for the whole walk, so its id stays unique.
            slot = slots[id(obj)] = TensorSlot(len(tensors))
            tensors.append(obj)
        return slot
    if refs is not None and t is TensorRef:
        ref_slot = slots.get(id(obj))
        if ref_slot is None:
            ref_slot = slots[id(obj)] = RefSlot(len(refs))
            refs.append(obj)
        return ref_slot
    return obj


def _too_deep(path: _Path) -> UnsafePayloadError:
    return UnsafePayloadError(
        f"payload nests more than {MAX_DEPTH} containers at {_path_text(path)} (or contains itself)"
    )


def _has_tensor(key: object) -> bool:
    if isinstance(key, torch.Tensor):
        return True
    if type(key) is tuple:
        return any(_has_tensor(k) for k in key)
    return False


def rebuild(tree: object, tensors: Sequence[torch.Tensor]) -> object:
    """Put ``tensors[i]`` back where :class:`TensorSlot` ``i`` is; the inverse of :func:`flatten`.

    :class:`RefSlot` placeholders are left as they are (refs are resolved by
    another layer). An index outside ``tensors`` raises :class:`CorruptRefError`.
    """
    return fill(tree, TensorSlot, tensors, "tensor", "the layout")


# ---------------------------------------------------------------- layout


def plan_layout(
    tensors: Sequence[torch.Tensor], *, alignment: int = 64, base: int = 0
) -> tuple[list[TensorSpec], int]:
    """Lay ``tensors`` out one after the other from byte ``base``.

    Each non-empty tensor starts at a multiple of ``max(alignment, itemsize)``
    and takes ``numel * itemsize`` bytes - an expanded (stride 0) tensor takes
    its full size, since the copy materializes it. Empty tensors take no
    bytes and get offset ``base``. Returns the specs, in tensor order, and
    the bytes used from ``base`` to the end of the last tensor (0 when there
    are no bytes to move); the region must hold ``base + total`` bytes.

    Raises :class:`InvalidArgumentError` for a dtype outside the whitelist, a
    sparse, nested, quantized or meta tensor, or an alignment that is not a
    power of two.
    """
    if alignment < 1 or alignment & (alignment - 1):
        raise InvalidArgumentError(f"alignment must be a power of two, got {alignment}")
    if base < 0:
        raise InvalidArgumentError(f"base must be >= 0, got {base}")
    specs: list[TensorSpec] = []
    cursor = base
    for index, tensor in enumerate(tensors):
        name = dtype_name(tensor.dtype)
        if tensor.layout is not torch.strided or tensor.is_nested or tensor.device.type == "meta":
            raise InvalidArgumentError(
                f"tensor {index} ({tensor.layout}{', nested' if tensor.is_nested else ''}, "
                f"on {tensor.device}) is not a dense tensor with data; only those can be sent"
            )
        nbytes = tensor.numel() * _ITEMSIZE[name]
        if nbytes:
            align = max(alignment, _ITEMSIZE[name])
            offset = -(-cursor // align) * align
            cursor = offset + nbytes
        else:
            offset = base
        specs.append(
            TensorSpec(index, tuple(tensor.shape), name, offset, nbytes, str(tensor.device))
        )
    return specs, cursor - base


def payload_nbytes(specs: Sequence[TensorSpec]) -> int:
    """Tensor bytes described by ``specs``, padding not included."""
    return sum(spec.nbytes for spec in specs)


def validate_layout(specs: Sequence[TensorSpec], region_len: int, *, alignment: int = 1) -> None:
    """Check a layout that came off the wire before any byte is touched.

    Raises :class:`CorruptRefError` unless: the indexes are exactly
    ``0..len(specs)-1``; every dtype is in the whitelist; every shape has at
    most 64 dims, none negative, and a product torch can index; ``nbytes``
    equals ``numel * itemsize``; offsets are non-negative; every tensor ends
    inside ``region_len``; non-empty tensors start at a multiple of
    ``max(alignment, itemsize)`` and do not overlap one another.
    """
    seen = [False] * len(specs)
    extents: list[tuple[int, int, int]] = []
    for position, spec in enumerate(specs):
        where = f"tensor layout entry {position}"
        index = spec.index
        if not _is_int(index) or not 0 <= index < len(specs) or seen[index]:
            raise CorruptRefError(
                f"{where}: index {index!r} is out of range or repeated ({len(specs)} tensors)"
            )
        seen[index] = True
        itemsize = _ITEMSIZE.get(spec.dtype) if type(spec.dtype) is str else None
        if itemsize is None:
            raise CorruptRefError(f"{where}: unknown dtype {spec.dtype!r}")
        shape = spec.shape
        if (
            type(shape) is not tuple
            or len(shape) > _MAX_NDIM
            or not all(_is_int(dim) and dim >= 0 for dim in shape)
        ):
            raise CorruptRefError(f"{where}: invalid shape {shape!r}")
        # Python ints: no overflow while checking whether torch would overflow.
        if math.prod(max(dim, 1) for dim in shape) > _MAX_ELEMENTS // itemsize:
            raise CorruptRefError(f"{where}: shape {shape} is too large")
        nbytes, offset = spec.nbytes, spec.offset
        if not _is_int(nbytes) or nbytes != math.prod(shape) * itemsize:
            raise CorruptRefError(
                f"{where}: nbytes {nbytes!r} does not match shape {shape} of {spec.dtype}"
            )
        if not _is_int(offset) or offset < 0 or offset + nbytes > region_len:
            raise CorruptRefError(
                f"{where}: bytes [{offset!r}, +{nbytes}) fall outside the region of "
                f"{region_len} bytes"
            )
        if nbytes:
            align = max(alignment, itemsize)
            if offset % align:
                raise CorruptRefError(
                    f"{where}: offset {offset} is not a multiple of {align} ({spec.dtype})"
                )
            extents.append((offset, offset + nbytes, position))
    extents.sort()
    for (_, prev_end, prev), (start, _, cur) in itertools.pairwise(extents):
        if start < prev_end:
            raise CorruptRefError(f"tensor layout entries {prev} and {cur} overlap at byte {start}")


def _is_int(value: object) -> bool:
    return type(value) is int


# ---------------------------------------------------------------- copies


def _check_region(region: torch.Tensor, what: str) -> None:
    if (
        region.dtype is not torch.uint8
        or region.dim() != 1
        or not region.is_contiguous()
        or region.device.type != "cpu"
    ):
        raise InvalidArgumentError(
            f"{what} must be a 1-D contiguous uint8 CPU tensor, got {region.dtype} "
            f"of shape {tuple(region.shape)} on {region.device}"
        )


def _check_aligned(address: int, spec: TensorSpec, dt: torch.dtype) -> None:
    if address % dt.itemsize:
        # torch's own error here would blame storage_offset; say what to fix.
        raise InvalidArgumentError(
            f"tensor {spec.index} at offset {spec.offset} is not {dt.itemsize}-byte aligned "
            "in memory; the region must start on an aligned address"
        )


def _typed_view(region: torch.Tensor, spec: TensorSpec, dt: torch.dtype) -> torch.Tensor:
    """``region[offset:offset+nbytes]`` seen as the spec's dtype and shape (no copy)."""
    _check_aligned(region.data_ptr() + spec.offset, spec, dt)
    return region[spec.offset : spec.offset + spec.nbytes].view(dt).view(spec.shape)


# One byte copy by address: (destination, source, nbytes). What a worker
# thread is handed instead of tensors: concurrent.futures keeps a call's
# arguments and result referenced until the worker runs again, so tensors
# given to it can outlive the caller's use of them by a scheduling delay. A
# reader's previous 16 MiB output, still alive there, made glibc grow the heap
# for the next one and fault all of it in (~4,100 faults, a 12 ms p99, in
# about one get in forty, measured). Addresses keep no memory alive.
Copy = tuple[int, int, int]


def _memcpy(dst: int, src: int, nbytes: int) -> None:
    """One single-threaded memcpy that releases the GIL.

    torch's ``copy_`` splits copies over its intra-op thread pool; on a busy
    node (two processes, two cores) the pool's barrier waits for a descheduled
    thread and a 256 KiB copy took 12 ms instead of 20 us. A contiguous CPU
    copy is a plain memcpy, which is also what the floor measures.
    """
    ctypes.memmove(dst, src, nbytes)


def pack_into(
    dst: torch.Tensor, tensors: Sequence[torch.Tensor], specs: Sequence[TensorSpec]
) -> None:
    """Copy each tensor into its place in ``dst``: one copy per tensor, nothing else.

    ``dst`` is the region (a 1-D uint8 CPU tensor, typically a view of shared
    memory); ``specs`` come from :func:`plan_layout` for the same tensors.
    The destination is a typed view, so ``copy_`` reads a non-contiguous,
    expanded, conjugated or negated source in place and materializes it
    straight into ``dst`` - no ``.contiguous()`` or ``resolve_conj()`` first -
    and copies a CUDA source device-to-host. Autograd is off: a source that
    requires grad is copied as data, and ``dst`` joins no graph.
    """
    _check_region(dst, "the destination")
    _pack(dst, 0, dst.numel(), tensors, specs)


def pack_at(
    view: torch.Tensor,
    start: int,
    length: int,
    tensors: Sequence[torch.Tensor],
    specs: Sequence[TensorSpec],
) -> None:
    """``pack_into(view[start:start + length], ...)``, slicing only if a tensor needs it.

    ``view`` is a whole mapped segment (checked when it was mapped). A put of
    plain host tensors copies by address; building the slice alone was ~10%
    of a put (measured).
    """
    _check_span(view, start, length)
    _pack(view, start, length, tensors, specs)


def pack_plan(
    view: torch.Tensor,
    start: int,
    length: int,
    tensors: Sequence[torch.Tensor],
    specs: Sequence[TensorSpec],
) -> list[Copy] | None:
    """:func:`pack_at`'s copies as addresses (see :data:`Copy`), checked as it checks them.

    None when a tensor is not one plain run of host memory: torch must copy
    it, so the caller uses :func:`pack_at`.
    """
    _check_span(view, start, length)
    plan: list[Copy] = []
    return plan if _pack(view, start, length, tensors, specs, plan) else None


def _check_span(view: torch.Tensor, start: int, length: int) -> None:
    if start < 0 or start + length > view.numel():
        raise InvalidArgumentError(f"bytes {start}..{start + length} lie outside the segment")


def _pack(
    view: torch.Tensor,
    start: int,
    size: int,
    tensors: Sequence[torch.Tensor],
    specs: Sequence[TensorSpec],
    plan: list[Copy] | None = None,
) -> bool:
    """Copy (or, given ``plan``, list the copies); False if ``plan`` cannot hold them all."""
    if len(tensors) != len(specs):
        raise InvalidArgumentError(f"{len(tensors)} tensors but {len(specs)} layout entries")
    base = view.data_ptr() + start
    dst = view if start == 0 and size == view.numel() else None
    for spec in specs:
        src = tensors[spec.index]
        dt = dtype_from_name(spec.dtype)
        if src.dtype != dt or src.shape != spec.shape:
            raise InvalidArgumentError(
                f"tensor {spec.index} is {src.dtype} {tuple(src.shape)}, but its layout "
                f"entry says {spec.dtype} {spec.shape}"
            )
        if not spec.nbytes:
            continue
        if spec.offset + spec.nbytes > size:
            raise InvalidArgumentError(
                f"tensor {spec.index} ends at byte {spec.offset + spec.nbytes}, past the "
                f"destination's {size} bytes"
            )
        address = base + spec.offset
        if address % dt.itemsize:
            _check_aligned(address, spec, dt)  # raises: the reader's views need it
        if _plain(src):
            # Straight to the address, no autograd mode to enter: a typed view
            # costs three tensor ops (~10 us here) only to be asked for its
            # data_ptr.
            if plan is None:
                _memcpy(address, src.data_ptr(), spec.nbytes)
            else:
                plan.append((address, src.data_ptr(), spec.nbytes))
        elif plan is not None:
            return False
        else:
            if dst is None:
                dst = view[start : start + size]
            with torch.no_grad():
                _typed_view(dst, spec, dt).copy_(src)
    return True


def _plain(src: torch.Tensor) -> bool:
    """Its bytes are one contiguous run of host memory, as they read."""
    return src.device.type == "cpu" and src.is_contiguous() and not (src.is_conj() or src.is_neg())


def pack_bytes(tensors: Sequence[torch.Tensor], specs: Sequence[TensorSpec], total: int) -> bytes:
    """The packed region of ``total`` bytes as ``bytes``: an inline payload.

    ``specs`` must come from :func:`plan_layout` of these ``tensors``. Plain
    host tensors are copied straight from their memory (one copy, no tensor
    wrapped around the buffer: ~9 -> ~1 us for one 4 KiB tensor, measured);
    anything else goes through :func:`pack_into`.
    """
    if not total:
        return b""
    if len(tensors) != len(specs) or not all(
        _plain(tensors[spec.index]) for spec in specs if spec.nbytes
    ):
        buf = bytearray(total)
        pack_into(torch.frombuffer(buf, dtype=torch.uint8), tensors, specs)
        return bytes(buf)
    for spec in specs:  # reading by address: a wrong spec must not read past a tensor
        src = tensors[spec.index]
        if src.dtype != _DTYPES[spec.dtype] or tuple(src.shape) != spec.shape:
            raise InvalidArgumentError(
                f"tensor {spec.index} is {src.dtype} {tuple(src.shape)}, but its layout "
                f"entry says {spec.dtype} {spec.shape}"
            )
        if spec.offset + spec.nbytes > total:
            raise InvalidArgumentError(f"tensor {spec.index} ends past the {total} packed bytes")
    if len(specs) == 1 and specs[0].offset == 0 and specs[0].nbytes == total:
        return ctypes.string_at(tensors[0].data_ptr(), total)
    buf = bytearray(total)
    base = ctypes.addressof((ctypes.c_char * total).from_buffer(buf))
    for spec in specs:
        if spec.nbytes:
            _memcpy(base + spec.offset, tensors[spec.index].data_ptr(), spec.nbytes)
    return bytes(buf)


def unpack_bytes(data: bytes, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
    """``unpack(copy=True)`` of an inline payload, read straight out of ``data``.

    The layout must already be validated against ``len(data)``.
    """
    return unpack_from(ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0, specs)


def unpack_from(base: int, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
    """``unpack(copy=True)`` of the region at address ``base``, with no tensor around it.

    The caller keeps the memory mapped and has validated the layout against
    the region's length.
    """
    out = allocate(specs)
    # Byte copies: plain memcpy for every dtype, bit exact (NaN payloads
    # included) and with no alignment requirement on the source.
    run_copies(copy_plan(base, specs, out))
    return out


def _empty(spec: TensorSpec, dt: torch.dtype) -> torch.Tensor:
    if dt is _COMPLEX32:
        # torch warns whenever a ComplexHalf tensor is allocated ("experimental");
        # bytes seen as complex32 are the same memory without the warning.
        return torch.empty(spec.nbytes, dtype=torch.uint8).view(dt).view(spec.shape)
    return torch.empty(spec.shape, dtype=dt)


def allocate(specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
    """Fresh tensors for ``specs``, in index order: what :func:`copy_plan` fills.

    For a caller that copies on a worker thread but allocates on its own: glibc
    gives each thread its own arena, and a worker's arena hands large frees
    back to the kernel, so every copy there faults its output in again (~100
    faults and a 10 ms p99 per 16 MiB get, measured). The main arena keeps them.
    """
    result: list[torch.Tensor | None] = [None] * len(specs)
    for spec in specs:
        result[spec.index] = _empty(spec, _DTYPES[spec.dtype])
    return result  # type: ignore[return-value]  # validated: every index filled once


def copy_plan(base: int, specs: Sequence[TensorSpec], out: Sequence[torch.Tensor]) -> list[Copy]:
    """The copies that fill ``out`` (from :func:`allocate`) from the region at ``base``."""
    return [(out[s.index].data_ptr(), base + s.offset, s.nbytes) for s in specs if s.nbytes]


def run_copies(plan: Sequence[Copy]) -> None:
    """Do the copies of :func:`copy_plan` or :func:`pack_plan` (on any thread)."""
    for dst, src, nbytes in plan:
        _memcpy(dst, src, nbytes)


def unpack(
    src: torch.Tensor,
    specs: Sequence[TensorSpec],
    *,
    copy: bool,
    validated: bool = False,
) -> list[torch.Tensor]:
    """The tensors described by ``specs`` in ``src``, in index order.

    ``src`` is the region as a 1-D uint8 CPU tensor. The layout is validated
    first (:func:`validate_layout`, against ``len(src)``). With ``copy=True``
    each tensor is a fresh allocation filled by one byte copy, so the region
    can be released right after; with ``copy=False`` they are views into
    ``src`` and valid only while the region is. Empty tensors are always
    fresh (there is nothing to view).
    """
    _check_region(src, "the source")
    if not validated:  # callers that checked the same layout already skip the second pass
        validate_layout(specs, src.numel())
    if copy:
        return unpack_from(src.data_ptr(), specs)
    result: list[torch.Tensor | None] = [None] * len(specs)
    for spec in specs:
        dt = _DTYPES[spec.dtype]
        result[spec.index] = _typed_view(src, spec, dt) if spec.nbytes else _empty(spec, dt)
    return result  # type: ignore[return-value]  # validate_layout: every index filled once
