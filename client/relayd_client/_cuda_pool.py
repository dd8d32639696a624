"""cuda_ipc_pool: the daemon's per-GPU slot pools, imported once, written and read.

Writer and reader in different processes, GPU -> GPU:

* the daemon owns one slot pool per GPU (:mod:`relayd.pools.cuda`); a client
  imports each pool once per process (:func:`import_pool`, cached) - the
  import is a ``cudaIpcOpenMemHandle``, far too slow per transfer;
* the writer leases slots exactly as for the arena, copies its tensors into
  the lease asynchronously on its current stream, records an interprocess
  event after the copies and sends the event's IPC handle in the DataRef
  (``cuda_event``); it keeps the event alive until the daemon frees the lease;
* the reader opens that event on the device its copy runs on (opening it on
  the source device can hang cross-GPU), makes a dedicated per-device copy
  stream wait on it (never its compute stream: the model's own work would
  stall behind the writer's queue), copies into a fresh tensor on its own
  device (peer to peer; staged through host memory on a worker thread where
  the two GPUs have no peer access), orders its current stream after the
  copy, waits for the copy with a deadline (a dead writer's event may never
  fire), checks the lease's generation again and releases;
* before a lease's slots go back to the writer's grant (the reader's
  release, abort, TTL), and before a writer lets its grants go (close,
  re-attach), the writer's copy into them must be known complete
  (:class:`._gpu_order.WriterFences`): a copy still queued would overwrite
  the next lease in those slots, and no generation check can see that;
* a lease is readable only while its writer's session lives: its event is
  the writer's, and CUDA leaves an imported event undefined once its
  exporter destroyed it, so the daemon reclaims a writer's published GPU
  leases when its session ends (a reader gets StaleRefError, never garbage);
  a writer that closes settles its copies first and keeps its events alive
  for a while in case a reader had opened one already;
* pools are imported per daemon epoch: attaching to a new epoch drops the
  old epoch's mappings (:func:`forget_pools`), which otherwise hold that GPU
  memory until the process exits.

The per-client side (the pools a daemon announced, their slot headers, the
writer's fences) is :class:`._cuda.GpuSide`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from . import _gpu_order
from ._cuda_copy import (
    ABANDONED,
    empty_like_spec,
    on_stream,
    open_shared_storage,
    run_on_worker,
    tensor_over,
)
from ._cuda_facts import local_ordinal, local_uuids, peer_access, reader_device, torch_cuda
from .wire.cuda_ipc import own_export
from .wire.errors import CorruptRefError, PeerUnavailableError, RelayTimeoutError
from .wire.proto import relay_pb2 as pb

# (node, daemon epoch, pool name, handle) -> the pool as a uint8 tensor on
# this process's ordinal of its GPU. Process-wide: any number of clients
# share one import.
_POOLS: dict[tuple[str, str, str, bytes], Any] = {}
pool_imports = 0  # how many imports this process made (tests check "once")


def import_pool(desc: pb.CudaPool, node: str = "", epoch: str = "") -> Any:
    """The pool ``desc`` of daemon ``(node, epoch)`` mapped into this process, imported at most once."""
    global pool_imports
    own = own_export(desc.storage.handle)
    if own is not None:
        return own
    key = (node, epoch, desc.name, bytes(desc.storage.handle))
    cached = _POOLS.get(key)
    if cached is not None:
        return cached
    ordinal = local_ordinal(desc.gpu_uuid, local_uuids())
    if ordinal is None:
        raise PeerUnavailableError(
            f"the data is in the GPU pool of {desc.gpu_uuid}, which this process cannot see "
            "(CUDA_VISIBLE_DEVICES?); make the GPU visible to the reader"
        )
    tensor = _open_storage(ordinal, desc.storage)
    if tensor.numel() < desc.nslots * desc.slot_size:
        raise CorruptRefError(f"pool {desc.name} is smaller than the daemon announced")
    _POOLS[key] = tensor
    pool_imports += 1
    return tensor


def _open_storage(ordinal: int, h: pb.CudaIpcHandle) -> Any:
    """The pool behind ``h`` as one uint8 tensor on ``cuda:<ordinal>``."""
    return tensor_over(
        open_shared_storage(ordinal, h), ordinal, "uint8", (h.storage_bytes,), (1,), 0
    )


def forget_pools(node: str, keep_epoch: str, collect: bool = True) -> int:
    """Drop this process's imports of node ``node``'s pools from epochs other than
    ``keep_epoch`` (a restarted daemon exports new pools; the old mappings
    would hold that GPU memory until this process exits). Returns how many.
    """
    stale = [k for k in _POOLS if k[0] == node and k[1] != keep_epoch]
    for key in stale:
        del _POOLS[key]
    if stale and collect:
        # The dropped tensors were the last holders of the mappings; what
        # PyTorch still keeps of them for IPC goes now, not at exit.
        torch_cuda().ipc_collect()
    return len(stale)


def write_pool(
    region: Any, tensors: Sequence[Any], specs: Sequence[Any], streams: Sequence[Any] = ()
) -> tuple[Any, bytes]:
    """Enqueue each tensor's copy into ``region`` (a uint8 slice of an imported pool)
    on the current stream of the pool's device, or on the producer's ``streams``
    when this runs on another thread than the producer's (see
    :func:`worker_streams`); returns the interprocess event recorded after the
    copies and its IPC handle. Nothing waits here."""
    return run_on_worker(streams, _write_pool, region, tensors, specs)  # type: ignore[no-any-return]


def _write_pool(region: Any, tensors: Sequence[Any], specs: Sequence[Any]) -> tuple[Any, bytes]:
    import torch

    from ._packing import dtype_from_name

    device = region.device
    with torch.cuda.device(device), torch.no_grad():
        stream = torch.cuda.current_stream(device)
        for spec in specs:
            if not spec.nbytes:
                continue
            dst = region[spec.offset : spec.offset + spec.nbytes]
            dst.view(dtype_from_name(spec.dtype)).view(spec.shape).copy_(
                tensors[spec.index], non_blocking=True
            )
        event = torch_cuda().Event(interprocess=True)
        event.record(stream)
        handle = bytes(event.ipc_handle())
    return event, handle


# A dedicated copy stream per device for reads (see _gpu_order.DedicatedStreams).
_COPY_STREAMS = _gpu_order.DedicatedStreams(lambda index: torch_cuda().Stream(device=index))


async def read_pool(
    region: Any, specs: Sequence[Any], event_handle: bytes, deadline: float
) -> list[Any]:
    """Copy the tensors out of a pool lease once the writer's event fired.

    Returns fresh tensors on :func:`reader_device` (a pool lease holds CUDA
    leaves only: a payload with CPU tensors goes through shm, see
    ``_cuda.carry_out_route``). Returns only when the copies
    are complete, so the lease can be released right after, and the
    caller's streams may use the tensors at once. RelayTimeoutError when
    they are not complete by ``deadline`` (a writer that died may leave an
    event that never fires).
    """

    dst = reader_device()
    copy_dev = dst if dst.type == "cuda" else region.device
    # Opened on the device whose stream runs the copy (see the module doc).
    try:
        ready = torch_cuda().Event.from_ipc_handle(copy_dev, event_handle)
    except RuntimeError as exc:
        raise PeerUnavailableError(
            f"cannot open the writer's CUDA event ({exc}); a writer that died before "
            "its copy was confirmed leaves nothing safe to read"
        ) from exc
    src_index = region.device.index
    devices = [src_index] + ([dst.index] if dst.type == "cuda" and dst.index != src_index else [])
    streams = [_COPY_STREAMS.get(i) for i in devices]
    same_or_peer = dst.type == "cuda" and peer_access(
        local_uuids()[src_index], local_uuids()[dst.index]
    )
    # Allocated on the caller's current stream, which uses (and frees) them.
    out: list[Any] = [None] * len(specs)
    for spec in specs:
        out[spec.index] = empty_like_spec(spec, dst)
    args = (region, specs, out, ready, streams, same_or_peer)
    if _gpu_order.copy_in_worker(dst.type == "cuda", same_or_peer):
        done = await asyncio.to_thread(
            _gpu_order.run_on_streams, streams, on_stream, _copy_out, *args
        )
    else:
        done = _gpu_order.run_on_streams(streams, on_stream, _copy_out, *args)
    try:
        await _gpu_order.wait_event(done, deadline, "the copy out of the GPU pool")
    except RelayTimeoutError:
        # The streams wait on an event that may never fire: later reads get
        # new ones, and the destinations stay held until the copy is done.
        ABANDONED.hold(done, out, ready, region)
        for i in devices:
            _COPY_STREAMS.discard(i)
        raise
    return out


def _copy_out(
    region: Any,
    specs: Sequence[Any],
    out: list[Any],
    ready: Any,
    streams: Sequence[Any],
    same_or_peer: bool,
) -> Any:
    """Enqueue the copies on the current (dedicated) streams; returns the event after them."""
    import torch

    # Every stream a copy below may run on waits for the writer: the pool
    # device's and the destination's (cross-device copies synchronize both).
    for s in streams:
        s.wait_event(ready)
    dst = out[0].device if out else region.device  # every leaf lands on one device
    with torch.no_grad():
        for spec in specs:
            if not spec.nbytes:
                continue
            src = region[spec.offset : spec.offset + spec.nbytes]
            flat = out[spec.index].view(-1).view(torch.uint8)
            if same_or_peer or dst.type == "cpu":
                flat.copy_(src, non_blocking=dst.type == "cuda")
            else:
                # No peer access: through host memory, explicitly (blocks: a worker thread).
                flat.copy_(src.to("cpu"), non_blocking=False)
    done = torch_cuda().Event()
    done.record(streams[-1])
    return done
