"""The client's GPU paths: GPU facts, the GPU route, cuda_ipc_pool, cuda_ipc_direct, pinning.

Importing this module never imports torch; every function that needs CUDA
imports it when called, so a CPU-only stage pays nothing.

GPU identity. A GPU is its UUID (``"GPU-58b9e9e8-..."``), never an ordinal:
``CUDA_VISIBLE_DEVICES`` remaps ordinals per process, so ``cuda:0`` in the
writer and ``cuda:0`` in the reader can be two GPUs. DataRefs carry
``"cuda:<uuid>"`` in ``TensorLayout.device`` and pools are named
``"cuda:<uuid>"``; each process maps a UUID to its own ordinal
(:func:`local_ordinal`).

Which processes "use CUDA". One that has initialized CUDA
(``torch.cuda.is_initialized()``) when it attaches or reads. Such a reader
gets CUDA leaves back on its current device; a process that never touched
CUDA gets CPU tensors and never creates a CUDA context (which would cost
GPU memory in every CPU stage on a GPU node). CPU leaves are always
restored on CPU.

cuda_ipc_pool (writer and reader in different processes, GPU -> GPU):

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

The route. The daemon's router picks the transport from both ends'
placements (it knows the reader's GPUs from its Attach and the peer-access
matrix it probed once per GPU pair); the client sends the payload's GPU
UUIDs with its Route request and :func:`choose_gpu_transport` maps the
answer onto what this client can do. A process reports the GPU it works
on at Attach only if it has initialized CUDA by then: open the client after
picking the device, or the edge is routed as GPU -> CPU (through shm, still
correct: CUDA leaves are restored on the reader's GPU).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import sys
import time
from collections.abc import Collection, Sequence
from typing import Any

from . import _gpu_order
from .wire.cuda_ipc import export_handle, own_export, uuid_of
from .wire.errors import CorruptRefError, PeerUnavailableError, RelayError, RelayTimeoutError
from .wire.proto import relay_pb2 as pb
from .wire.transport import DIRECT_META_LIMIT, Transport

log = logging.getLogger(__name__)

# cudaHostRegisterPortable: pinned for every CUDA context of the process,
# not only the current device's (a stage may drive several GPUs).
_HOST_REGISTER_PORTABLE = 1

# ---------------------------------------------------------------- identity


def _tc() -> Any:
    """``torch.cuda`` as Any: its Event and cudart have no type hints."""
    import torch

    return torch.cuda


def device_field(uuid: str) -> str:
    """``TensorLayout.device`` of a tensor on GPU ``uuid``."""
    return f"cuda:{uuid}"


def leaf_gpu(device: str) -> str | None:
    """The GPU UUID of a ``TensorLayout.device``; None for a CPU tensor.

    An ordinal (``"cuda:0"``) names a GPU only inside the writer; it is
    accepted as "some GPU" (``""``) so a CUDA leaf still lands on a GPU.
    """
    if device == "cpu" or not device:
        return None
    if not device.startswith("cuda:"):
        raise CorruptRefError(f"tensor device {device[:80]!r} is neither cpu nor cuda:<uuid>")
    rest = device[5:]
    return "" if rest.isdigit() else rest


def local_ordinal(uuid: str, local: Sequence[str]) -> int | None:
    """This process's ordinal of GPU ``uuid`` given its UUIDs in ordinal order."""
    for ordinal, candidate in enumerate(local):
        if candidate == uuid:
            return ordinal
    return None


@functools.cache
def local_uuids() -> tuple[str, ...]:
    """UUIDs of the GPUs this process sees, by its own ordinal (initializes CUDA)."""
    import torch

    return tuple(
        uuid_of(torch.cuda.get_device_properties(i)) for i in range(torch.cuda.device_count())
    )


def uses_cuda() -> bool:
    """This process has initialized CUDA (never initializes it itself)."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


def used_gpus() -> tuple[str, ...]:
    """GPUs this process works on, for Attach: its current device, if it uses CUDA."""
    if not uses_cuda():
        return ()
    import torch

    return (local_uuids()[torch.cuda.current_device()],)


@functools.cache
def _peer_ok(src_ordinal: int, dst_ordinal: int) -> bool:
    import torch

    return bool(torch.cuda.can_device_access_peer(dst_ordinal, src_ordinal))


def peer_access(src_uuid: str, dst_uuid: str) -> bool:
    """Can GPU ``dst`` read ``src`` directly; probed once per pair per process."""
    if src_uuid == dst_uuid:
        return True
    local = local_uuids()
    src, dst = local_ordinal(src_uuid, local), local_ordinal(dst_uuid, local)
    return src is not None and dst is not None and _peer_ok(src, dst)


# ---------------------------------------------------------------- the route


@dataclasses.dataclass(frozen=True, slots=True)
class PayloadGpuFacts:
    """What one put holds, as far as the GPU rows care."""

    cuda_uuids: tuple[str, ...] = ()  # distinct, sorted
    has_cpu_tensors: bool = False
    direct_meta_bytes: int = 0  # DataRef size if CUDA tensors travel as handles


# Handle, event handle, refcount file name, strides: what one tensor adds.
_DIRECT_BYTES_PER_TENSOR = 320


def payload_facts(devices: Sequence[str], header_bytes: int = 0) -> PayloadGpuFacts:
    """Facts from the ``TensorLayout.device`` of every non-empty tensor."""
    gpus = {g for g in (leaf_gpu(d) for d in devices) if g is not None}
    n_cuda = sum(1 for d in devices if leaf_gpu(d) is not None)
    return PayloadGpuFacts(
        cuda_uuids=tuple(sorted(gpus)),
        has_cpu_tensors=any(leaf_gpu(d) is None for d in devices),
        direct_meta_bytes=direct_meta_estimate(n_cuda, header_bytes),
    )


def direct_meta_estimate(n_cuda_tensors: int, header_bytes: int = 0) -> int:
    """Roughly how large a DataRef gets when ``n`` CUDA tensors travel as handles."""
    return header_bytes + _DIRECT_BYTES_PER_TENSOR * n_cuda_tensors


def choose_gpu_transport(
    facts: PayloadGpuFacts, *, pools: Collection[str], daemon_route: Transport
) -> Transport:
    """What this client does with a put the daemon routed ``daemon_route``.

    The daemon's router (``relayd.routing.router.route``, rows 5-7) knows the
    reader's GPUs and the peer-access matrix; the client knows what it can
    do: one lease lives in one GPU pool, so a pooled payload must sit on one
    GPU that has a pool, and handles must fit the DataRef. Anything else
    stages through shm, which serves every reader.
    """
    src = facts.cuda_uuids
    if not src or "" in src or facts.has_cpu_tensors:
        return Transport.SHM  # no CUDA tensors, an unnamed GPU, or mixed CPU/CUDA
    if daemon_route is Transport.CUDA_IPC_DIRECT and facts.direct_meta_bytes <= DIRECT_META_LIMIT:
        return Transport.CUDA_IPC_DIRECT
    pooled = daemon_route in (Transport.CUDA_IPC_DIRECT, Transport.CUDA_IPC_POOL)
    if pooled and len(src) == 1 and src[0] in pools:
        return Transport.CUDA_IPC_POOL
    return Transport.SHM


# ---------------------------------------------------------------- pool import

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
    tensor = _open_storage(ordinal, desc.storage, "uint8", (desc.storage.storage_bytes,), (1,), 0)
    if tensor.numel() < desc.nslots * desc.slot_size:
        raise CorruptRefError(f"pool {desc.name} is smaller than the daemon announced")
    _POOLS[key] = tensor
    pool_imports += 1
    return tensor


def _open_storage(
    ordinal: int,
    h: pb.CudaIpcHandle,
    dtype: str,
    shape: Sequence[int],
    stride: Sequence[int],
    storage_offset: int,
) -> Any:
    """A tensor over a storage another process exported (``torch.multiprocessing``'s rebuild)."""
    import torch

    from ._packing import dtype_from_name

    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            ordinal,
            h.handle,
            h.storage_bytes,
            h.storage_offset_bytes,
            h.ref_counter_handle,
            h.ref_counter_offset,
            h.event_handle,
            h.event_sync_required,
        )
    except RuntimeError as exc:
        raise PeerUnavailableError(
            f"cannot open a CUDA IPC handle on cuda:{ordinal}: {exc}"
        ) from exc
    out = torch.empty((0,), dtype=dtype_from_name(dtype), device=f"cuda:{ordinal}")
    return out.set_(storage, storage_offset, tuple(shape), tuple(stride))


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
        _tc().ipc_collect()
    return len(stale)


# ---------------------------------------------------------------- pool copies


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
        event = _tc().Event(interprocess=True)
        event.record(stream)
        handle = bytes(event.ipc_handle())
    return event, handle


def _empty_like_spec(spec: Any, device: Any) -> Any:
    import torch

    from ._packing import dtype_from_name

    # Bytes seen as the dtype: no ComplexHalf allocation warning, same memory.
    raw = torch.empty(spec.nbytes, dtype=torch.uint8, device=device)
    return raw.view(dtype_from_name(spec.dtype)).view(spec.shape)


def reader_device() -> Any:
    """Where this process's CUDA leaves land: its current GPU, or the CPU."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if uses_cuda() else torch.device("cpu")


# A dedicated copy stream per device for reads (see _gpu_order.DedicatedStreams).
_COPY_STREAMS = _gpu_order.DedicatedStreams(lambda index: _tc().Stream(device=index))
# Destinations of copies abandoned at their deadline: the copy may still run.
_ABANDONED = _gpu_order.Quarantine()


async def read_pool(
    region: Any, specs: Sequence[Any], event_handle: bytes, deadline: float
) -> list[Any]:
    """Copy the tensors out of a pool lease once the writer's event fired.

    Returns fresh tensors: CUDA leaves on :func:`reader_device`, CPU leaves
    (there are none on this path today) on CPU. Returns only when the copies
    are complete, so the lease can be released right after, and the
    caller's streams may use the tensors at once. RelayTimeoutError when
    they are not complete by ``deadline`` (a writer that died may leave an
    event that never fires).
    """
    import torch

    dst = reader_device()
    copy_dev = dst if dst.type == "cuda" else region.device
    with torch.cuda.device(copy_dev):
        # Opened on the device whose stream runs the copy (see the module doc).
        try:
            ready = _tc().Event.from_ipc_handle(copy_dev, event_handle)
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
        out[spec.index] = _empty_like_spec(spec, dst)
    args = (region, specs, out, ready, streams, same_or_peer)
    if _gpu_order.copy_in_worker(dst.type == "cuda", same_or_peer):
        done = await asyncio.to_thread(
            _gpu_order.run_on_streams, streams, torch.cuda.stream, _copy_out, *args
        )
    else:
        done = _gpu_order.run_on_streams(streams, torch.cuda.stream, _copy_out, *args)
    try:
        await _gpu_order.wait_event(done, deadline, "the copy out of the GPU pool")
    except RelayTimeoutError:
        # The streams wait on an event that may never fire: later reads get
        # new ones, and the destinations stay held until the copy is done.
        _ABANDONED.hold(done, out, ready, region)
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
    done = _tc().Event()
    done.record(streams[-1])
    return done


async def wait_event(event: Any, deadline: float | None = None, what: str = "a GPU copy") -> None:
    """Wait for a CUDA event without blocking the event loop, up to ``deadline``."""
    limit = time.monotonic() + _GPU_WAIT_S if deadline is None else deadline
    await _gpu_order.wait_event(event, limit, what)


# How long a GPU copy of this process's own may take when no deadline is given.
_GPU_WAIT_S = 60.0


# ---------------------------------------------------------------- direct


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
    release = release or _release_counter
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


def _release_counter(h: pb.CudaIpcHandle) -> None:
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
    try:
        opened = storage._new_shared_cuda(
            ordinal,
            h.handle,
            h.storage_bytes,
            h.storage_offset_bytes,
            h.ref_counter_handle,
            h.ref_counter_offset,
            h.event_handle,
            h.event_sync_required,
        )
    except RuntimeError as exc:
        raise PeerUnavailableError(
            f"cannot open a CUDA IPC handle on cuda:{ordinal}: {exc}"
        ) from exc
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
            out[spec.index] = _empty_like_spec(spec, dst)
            continue
        uuid = leaf_gpu(spec.device)
        ordinal = None if not uuid else local_ordinal(uuid, local)
        if ordinal is None:
            raise PeerUnavailableError(
                f"direct CUDA IPC tensor on GPU {uuid or '?'} which this process cannot see"
            )
        itemsize = dtype_from_name(spec.dtype).itemsize
        check_direct_handle(h, spec.shape, itemsize)
        storage = _open_direct(ordinal, h)
        tensor = torch.empty((0,), dtype=dtype_from_name(spec.dtype), device=f"cuda:{ordinal}")
        tensor.set_(storage, h.storage_offset, tuple(spec.shape), tuple(h.stride))
        storage = None  # only the tensors hold it: see the drop below
        if copy or tensor.device != dst:
            shared.append(tensor)
            tensor = tensor.to(dst, copy=True, non_blocking=dst.type == "cuda")
        out[spec.index] = tensor
    if shared and dst.type == "cuda":
        # The copies must be done before the writer's memory is let go.
        with torch.cuda.device(dst):
            done = _tc().Event()
            done.record(torch.cuda.current_stream(dst))
        try:
            await wait_event(done, deadline, "the copy out of a direct CUDA IPC tensor")
        except RelayTimeoutError:
            _ABANDONED.hold(done, out, shared)
            raise
    if shared:
        # Freeing an imported storage synchronizes a stream (PyTorch's IPC
        # deleter): on a worker thread, not the event loop.
        await asyncio.to_thread(_drop, shared)
    return out


def _drop(objs: list[Any]) -> None:
    objs.clear()


# ---------------------------------------------------------------- shm writes


def worker_streams(tensors: Sequence[Any]) -> tuple[Any, ...]:
    """The calling thread's current stream on each device of the CUDA tensors, for
    :func:`run_on_worker`: a copy on a worker thread must run after the
    producer's work on these streams (see :func:`._gpu_order.caller_streams`)."""
    if not uses_cuda():
        return ()
    devices = (t.device.index if t.is_cuda else None for t in tensors)
    return _gpu_order.caller_streams(devices, _tc().current_stream)


def run_on_worker(streams: Sequence[Any], fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on this (worker) thread with the caller's ``streams`` current."""
    if not streams:
        return fn(*args)
    return _gpu_order.run_on_streams(streams, _tc().stream, fn, *args)


# ---------------------------------------------------------------- pinned staging


def pin_host(views: Sequence[Any], mode: str) -> list[int]:
    """Page-lock the arena mappings (``cudaHostRegister``) so GPU copies through
    them are DMA; returns the registered addresses for :func:`unpin_host`.

    Only in a process that uses CUDA, and not when the daemon says ``off``. A
    failure (RLIMIT_MEMLOCK, usually) is an error with ``on`` and a warning
    with ``auto``: the arena still works, through pageable copies.
    """
    if mode == "off" or not uses_cuda():
        return []

    cudart = _tc().cudart()
    pinned: list[int] = []
    for view in views:
        ptr, size = int(view.data_ptr()), int(view.numel())
        rc = cudart.cudaHostRegister(ptr, size, _HOST_REGISTER_PORTABLE)
        if int(rc) != 0:
            _clear_cuda_error()
            unpin_host(pinned)
            message = (
                f"cudaHostRegister of {size} arena bytes failed (error {int(rc)}); raise "
                "RLIMIT_MEMLOCK (ulimit -l unlimited) for page-locked staging"
            )
            if mode == "on":
                raise RelayError(message)
            log.warning("%s; GPU copies through the arena stay pageable", message)
            return []
        pinned.append(ptr)
    return pinned


def unpin_host(pinned: list[int]) -> None:
    if not pinned:
        return

    cudart = _tc().cudart()
    failed = False
    for ptr in pinned:
        with contextlib.suppress(RuntimeError):
            failed |= int(cudart.cudaHostUnregister(ptr)) != 0
    pinned.clear()
    if failed:
        _clear_cuda_error()


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed call handled here.

    ``torch.cuda.cudart()`` returns the error code of ``cudaHostRegister``
    without clearing it, and PyTorch's next kernel-launch check
    (``cudaGetLastError``) in this thread would then fail an unrelated
    kernel with it. The binding has no ``cudaGetLastError``, so it is called
    through ctypes on the libcudart this process already loaded (the same
    instance torch uses); a torch that links cudart statically is left as is.
    """
    import ctypes

    with contextlib.suppress(Exception):
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {
                line.split(None, 5)[5].strip()
                for line in maps
                if "libcudart.so" in line and len(line.split(None, 5)) == 6
            }
        for path in sorted(paths):
            ctypes.CDLL(path).cudaGetLastError()


async def restore_on_device(
    tensors: list[Any], specs: Sequence[Any], copy: bool, deadline: float | None = None
) -> list[Any]:
    """Put the CUDA leaves of an shm read back on this process's GPU.

    ``tensors`` are views into the arena (or copies when ``copy`` is set for
    CPU leaves). The host-to-device copies read the (pinned) arena directly;
    this returns once they are complete, so the lease can be released.
    """
    import torch

    dst = reader_device()
    if dst.type != "cuda":
        return [t.clone() if copy else t for t in tensors]
    out = list(tensors)
    moved = False
    with torch.no_grad():
        for spec in specs:
            if leaf_gpu(spec.device) is None:
                if copy:
                    out[spec.index] = tensors[spec.index].clone()
                continue
            out[spec.index] = tensors[spec.index].to(dst, non_blocking=True)
            moved = True
    if moved:
        with torch.cuda.device(dst):
            done = _tc().Event()
            done.record(torch.cuda.current_stream(dst))
        await wait_event(done, deadline, "the copy from the arena to the GPU")
    return out


# ---------------------------------------------------------------- per-client state


# Events of a closed client's published pool leases, kept until the time
# given (a reader may have opened one already; see the module doc).
_LINGERING: list[tuple[float, Any]] = []
LINGER_EVENTS_S = 30.0


def _linger(events: Sequence[Any], now: float) -> None:
    _LINGERING[:] = [(t, e) for t, e in _LINGERING if t > now]
    _LINGERING.extend((now + LINGER_EVENTS_S, e) for e in events)


class GpuSide:
    """One RelayClient's GPU state: the daemon's pools, their slot headers,
    the writer's fences of its pool leases, direct refs read, the pinned
    arena and known readers."""

    def __init__(self, attach: pb.AttachResponse, views: Sequence[Any]) -> None:
        from .wire.shm import HEADER_STRIDE, MappedSegment

        self.node_id = attach.node_id
        self.epoch = attach.daemon_epoch
        self.pin_mode = attach.pin_host_memory or "auto"
        self.pools: dict[str, pb.CudaPool] = {p.gpu_uuid: p for p in attach.cuda_pools}
        self.by_name: dict[str, pb.CudaPool] = {p.name: p for p in attach.cuda_pools}
        self.headers: dict[str, MappedSegment] = {}
        self.fences = _gpu_order.WriterFences()
        self.direct_reads = _gpu_order.ReadOnce()
        # A new epoch of this node's daemon: the old one's pools are gone.
        forget_pools(self.node_id, self.epoch)
        # Benchmarks and tests pin a GPU transport here instead of asking the
        # router (two stages in one benchmark cannot be placed apart).
        self.force: Transport | None = None
        self._views = list(views)
        self._pinned: list[int] = []
        self._pin_tried = False
        try:
            for p in attach.cuda_pools:
                h = p.headers
                seg = MappedSegment(h.name, h.size, 0, HEADER_STRIDE)
                self.headers[p.name] = seg
                if seg.nslots < p.nslots:
                    raise CorruptRefError(f"pool {p.name}: header segment too small")
            self.ensure_pinned()
        except BaseException:
            self.close()
            raise

    def ensure_pinned(self) -> None:
        """Page-lock the arena once this process uses CUDA (at attach, or later)."""
        if not self._pin_tried and uses_cuda():
            self._pin_tried = True
            self._pinned = pin_host(self._views, self.pin_mode)

    @property
    def pinned(self) -> bool:
        return bool(self._pinned)

    def route(self, specs: Sequence[Any], header_bytes: int, daemon_route: Transport) -> Transport:
        devices = [s.device for s in specs if s.nbytes]
        if not any(leaf_gpu(d) is not None for d in devices):
            return Transport.SHM
        self.ensure_pinned()  # CUDA is in use now, if it was not at attach
        return choose_gpu_transport(
            payload_facts(devices, header_bytes),
            pools=self.pools.keys(),
            daemon_route=self.force or daemon_route,
        )

    def has_pool_for(self, specs: Sequence[Any]) -> bool:
        gpus = payload_facts([s.device for s in specs if s.nbytes]).cuda_uuids
        return len(gpus) == 1 and gpus[0] in self.pools

    def fits(self, pool: str, slot: int, nslots: int) -> bool:
        desc = self.by_name.get(pool)
        return desc is not None and slot + nslots <= desc.nslots

    def pool_region(self, pool: str, slot: int, nbytes: int) -> Any:
        desc = self.by_name[pool]
        start = slot * desc.slot_size
        return import_pool(desc, self.node_id, self.epoch)[start : start + nbytes]

    def lease_region(self, m: pb.DataRef) -> tuple[Any, Any]:
        """(header segment, pool region) of a cuda_ipc_pool DataRef, checked."""
        from .wire.errors import StaleEpochError, StaleRefError

        if m.origin.node_id != self.node_id:
            raise PeerUnavailableError(
                f"GPU pool DataRef from node {m.origin.node_id!r}; GPU pools are per node"
            )
        if m.origin.daemon_epoch != self.epoch:
            raise StaleEpochError("the daemon restarted since this DataRef was written")
        lease = m.lease
        desc = self.by_name.get(lease.pool)
        if desc is None or lease.segment != 0:
            raise CorruptRefError(f"DataRef names unknown GPU pool {lease.pool[:80]!r}")
        if (
            lease.slot + lease.nslots > desc.nslots
            or lease.length > lease.nslots * desc.slot_size
            or lease.offset != lease.slot * desc.slot_size
        ):
            raise CorruptRefError("DataRef lease lies outside its GPU pool")
        if len(m.cuda_event) != 64:
            raise CorruptRefError("cuda_ipc_pool DataRef without a valid event handle")
        seg = self.headers[lease.pool]
        gen, length = seg.read_header(lease.slot)
        if gen != lease.generation or length != lease.length:
            raise StaleRefError(
                "DataRef's GPU lease was already read, reclaimed (TTL), aborted, or its "
                "writer's session ended (GPU pool leases do not outlive their writer)"
            )
        return seg, self.pool_region(lease.pool, lease.slot, lease.length)

    def keep_event(self, lease_id: int, event: Any) -> None:
        # The reader opens the event by handle; it must exist until then, and
        # the lease's slots are not reused before it fired.
        self.fences.add(lease_id, event)

    def free_slots(self, lease_id: int, release: Any) -> bool:
        """Hand a lease's slots back through ``release`` once the writer's copy
        into them is known complete; True if that was now."""
        return self.fences.free(lease_id, release)

    async def settle(self, timeout: float) -> None:
        """Before the grants go (close, re-attach): every queued copy into them is done."""
        late = await self.fences.settle(time.monotonic() + timeout)
        if late:
            log.error(
                "%d copies into GPU leases were still queued after %.1f s; their slots may "
                "be overwritten once the daemon reuses them",
                late,
                timeout,
            )

    def close(self) -> None:
        unpin_host(self._pinned)
        for seg in self.headers.values():
            seg.close()
        self.headers.clear()
        self.fences.cancel()
        _linger(list(self.fences.events.values()), time.monotonic())
        self.fences.events.clear()
        self._views.clear()


def restores_on_gpu(specs: Sequence[Any]) -> bool:
    """An shm read whose CUDA leaves go back to a GPU in this process."""
    return uses_cuda() and any(leaf_gpu(s.device) is not None for s in specs)


def name_gpus(specs: list[Any]) -> list[Any]:
    """Replace ``cuda:<ordinal>`` by ``cuda:<uuid>`` in the writer's layout."""
    if not any(s.device.startswith("cuda") for s in specs):
        return specs
    local = local_uuids()
    out = []
    for s in specs:
        if s.device.startswith("cuda"):
            index = int(s.device.partition(":")[2] or 0)
            s = dataclasses.replace(s, device=device_field(local[index]))
        out.append(s)
    return out
