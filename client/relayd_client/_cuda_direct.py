"""cuda_ipc_direct: a CUDA tensor travels as its PyTorch storage handle.

cuda_ipc_direct (writer and reader share the GPU) is **opt-in**
(``RelayClient(..., cuda_ipc_direct=True)``; the router takes it only then):
each CUDA tensor travels as its PyTorch storage handle
(``UntypedStorage._share_cuda_``, the way ``torch.multiprocessing`` sends
CUDA tensors) in ``TensorLayout.cuda_ipc``; there is no pool and no lease.
Why opt-in rather than the default with lease-like bookkeeping: PyTorch
counts one reference per share and only a reader's import releases it, so
a ref that is never read (dropped, aborted, expired) keeps the writer's
block and its event in PyTorch's limbo for the life of the writer's process,
every share past ~1,000 outstanding synchronizes the whole stream inside
``put``, and nothing outlives the writer's process. Making abort and TTL
reach the writer would need a lease per direct put, notices to the writer
and a writer-side table of tensors to release: the pool path already is
that machinery, costs one device-to-device copy, and fails safe. So the
default is the pool, and a stage that opts into direct takes on PyTorch's
contract: **read every ref exactly once, keep the tensors alive, unmodified,
and the writer's process running until the reader is done.** Within that
contract this module: refuses a second read in the same process
(:class:`._gpu_order.ReadOnce`); releases the counts already taken when an
export fails midway and the put falls back to the pool; caches mappings per
(handle, offset) in PyTorch's own ``shared_cache`` (a hit releases the new
share's count, as ``torch.multiprocessing`` does); and drops imported
storages on a worker thread (PyTorch synchronizes a stream when it frees
one). ``get(copy=True)`` hands the reader its own copy; ``copy=False`` a
tensor sharing the writer's memory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from ._cuda_copy import (
    ABANDONED,
    empty_like_spec,
    open_shared_storage,
    run_on_worker,
    tensor_over,
    wait_event,
)
from ._cuda_facts import leaf_gpu, local_ordinal, local_uuids, reader_device, torch_cuda
from .wire.cuda_ipc import export_handle
from .wire.errors import CorruptRefError, PeerUnavailableError, RelayTimeoutError
from .wire.proto import relay_pb2 as pb

log = logging.getLogger(__name__)


def export_direct(tensor: Any) -> pb.CudaIpcHandle:
    """The CUDA storage handle of ``tensor`` plus its view (strides, offset)."""
    h = export_handle(tensor.untyped_storage()._share_cuda_())
    h.stride.extend(tensor.stride())
    h.storage_offset = int(tensor.storage_offset())
    return h


def export_all_direct(
    tensors: Sequence[Any],
    specs: Sequence[Any],
    export: Any = None,
    release: Any = None,
    streams: Sequence[Any] = (),
) -> list[pb.CudaIpcHandle | None] | None:
    """One handle per spec (None for an empty tensor), or None if one cannot be exported.

    ``_share_cuda_`` records the event a reader waits on on the current
    stream: the producer's ``streams`` when this runs on another thread.

    Each export takes a PyTorch IPC reference count that only a reader's
    import gives back; when a later tensor fails (memory PyTorch imported
    itself, an allocator without IPC), the counts already taken are given
    back here, or the writer's blocks would stay in limbo.
    """
    export = export or export_direct
    release = release or release_counter
    out: list[pb.CudaIpcHandle | None] = []

    def export_each() -> None:
        for spec in specs:
            out.append(export(tensors[spec.index]) if spec.nbytes else None)

    try:
        run_on_worker(streams, export_each)
    except RuntimeError as exc:
        log.debug("direct CUDA IPC not possible (%s); using the GPU pool", exc)
        for h in out:
            if h is not None and h.ref_counter_handle:
                release(h)
        return None
    return out


def release_counter(h: pb.CudaIpcHandle) -> None:
    import torch

    storage: Any = torch.UntypedStorage
    storage._release_ipc_counter_cuda(h.ref_counter_handle, h.ref_counter_offset)


def check_direct_handle(h: pb.CudaIpcHandle, shape: Sequence[int], itemsize: int) -> None:
    """A view that stays inside its storage (the handle came off the wire)."""
    if len(h.stride) != len(shape) or any(s < 0 for s in h.stride):
        raise CorruptRefError("direct CUDA handle: strides do not match the shape")
    last = h.storage_offset + sum((d - 1) * s for d, s in zip(shape, h.stride, strict=True) if d)
    if all(shape) and (last + 1) * itemsize > h.storage_bytes:
        raise CorruptRefError("direct CUDA handle: the view reaches past its storage")


def _open_direct(ordinal: int, h: pb.CudaIpcHandle) -> Any:
    """The writer's storage behind ``h``, through PyTorch's own cache per (handle, offset).

    As ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` does: a
    storage this process still holds is reused, and the new share's
    reference count is released at once (the held storage already counts).
    """
    import torch
    from torch.multiprocessing import reductions as _reductions

    reductions: Any = _reductions  # untyped
    key = (bytes(h.handle), int(h.storage_offset_bytes))
    storage: Any = torch.UntypedStorage
    cached = reductions.storage_from_cache(storage, key)
    if cached is not None:
        if h.ref_counter_handle:
            storage._release_ipc_counter_cuda(h.ref_counter_handle, h.ref_counter_offset)
        direct_cache_hits.append(key)
        return cached
    opened = open_shared_storage(ordinal, h)
    reductions.shared_cache[key] = reductions.StorageWeakRef(opened)
    return opened


# (handle, offset) of each direct read served from the cache (tests read it).
direct_cache_hits: list[tuple[bytes, int]] = []


async def read_direct(
    specs: Sequence[Any], handles: Sequence[pb.CudaIpcHandle], copy: bool, deadline: float
) -> list[Any]:
    """Open each tensor's storage on this process's ordinal of its GPU."""
    import torch

    from ._packing import dtype_from_name

    local = local_uuids()
    dst = reader_device()
    out: list[Any] = [None] * len(specs)
    shared: list[Any] = []
    for spec, h in zip(specs, handles, strict=True):
        if not spec.nbytes:  # empty tensors travel without a handle
            out[spec.index] = empty_like_spec(spec, dst)
            continue
        uuid = leaf_gpu(spec.device)
        ordinal = None if not uuid else local_ordinal(uuid, local)
        if ordinal is None:
            raise PeerUnavailableError(
                f"direct CUDA IPC tensor on GPU {uuid or '?'} which this process cannot see"
            )
        itemsize = dtype_from_name(spec.dtype).itemsize
        check_direct_handle(h, spec.shape, itemsize)
        # Only the tensors hold the storage: see the drop below.
        storage = _open_direct(ordinal, h)
        tensor = tensor_over(storage, ordinal, spec.dtype, spec.shape, h.stride, h.storage_offset)
        storage = None
        if copy or tensor.device != dst:
            shared.append(tensor)
            tensor = tensor.to(dst, copy=True, non_blocking=dst.type == "cuda")
        out[spec.index] = tensor
    if shared and dst.type == "cuda":
        # The copies must be done before the writer's memory is let go.
        with torch.cuda.device(dst):
            done = torch_cuda().Event()
            done.record(torch.cuda.current_stream(dst))
        try:
            await wait_event(done, deadline, "the copy out of a direct CUDA IPC tensor")
        except RelayTimeoutError:
            ABANDONED.hold(done, out, shared)
            raise
    if shared:
        # Freeing an imported storage synchronizes a stream (PyTorch's IPC
        # deleter): on a worker thread, not the event loop.
        await asyncio.to_thread(_drop, shared)
    return out


def _drop(objs: list[Any]) -> None:
    objs.clear()
