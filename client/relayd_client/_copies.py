"""Copies between tensors and a region: the writer's copy in, the reader's copy out.

A region is a lease's data in a mapped segment, or a DataRef's inline bytes;
``_packing`` says where each tensor sits in it (a :class:`TensorSpec`).

Writer side::

    pack_into(region, tensors, specs)         # one copy per tensor, into shared memory

Reader side::

    tensors = unpack(region, specs, copy=True)  # validates the layout first

Contiguous host tensors are copied by address with one ``memmove`` each
(:func:`memcpy` says why not ``copy_``); anything else (a view, a conjugate,
a CUDA tensor) goes through ``copy_`` into a typed view of the region.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from relayd_client._packing import _COMPLEX32, _DTYPES, TensorSpec, dtype_from_name, validate_layout
from relayd_client.wire.errors import InvalidArgumentError

__all__ = [
    "Copy",
    "allocate",
    "copy_plan",
    "pack_at",
    "pack_bytes",
    "pack_into",
    "pack_plan",
    "run_copies",
    "unpack",
    "unpack_bytes",
    "unpack_from",
]


def _check_region(region: torch.Tensor, what: str) -> None:
    if (
        region.dtype is not torch.uint8
        or region.dim() != 1
        or not region.is_contiguous()
        or not region.is_cpu
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


def memcpy(dst: int, src: int, nbytes: int) -> None:
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
        if plain(src):
            # Straight to the address, no autograd mode to enter: a typed view
            # costs three tensor ops (~10 us here) only to be asked for its
            # data_ptr.
            if plan is None:
                memcpy(address, src.data_ptr(), spec.nbytes)
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


def plain(src: torch.Tensor) -> bool:
    """Its bytes are one contiguous run of host memory, as they read."""
    # is_cpu, not device.type: that builds a device object and its name, 1.5 us
    # here against 0.2, on every tensor of every put.
    return src.is_cpu and src.is_contiguous() and not (src.is_conj() or src.is_neg())


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
        plain(tensors[spec.index]) for spec in specs if spec.nbytes
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
            memcpy(base + spec.offset, tensors[spec.index].data_ptr(), spec.nbytes)
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
        memcpy(dst, src, nbytes)


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
