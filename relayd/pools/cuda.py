"""Daemon-owned GPU slot pools, exported once over CUDA IPC.

One pool per visible GPU when ``gpu_pool_size > 0`` and CUDA is present:

* **Allocated once at start** as ``torch.empty(size, dtype=uint8)`` on the
  GPU. That is a plain ``cudaMalloc`` through PyTorch's caching allocator: a
  request this large gets a segment of its own (rounded up to 2 MiB), and
  since the pool tensor lives as long as the daemon, the allocator never
  hands its memory to anything else. ``PYTORCH_CUDA_ALLOC_CONF`` with
  ``expandable_segments:True`` is refused at preflight: memory from
  expandable segments is mapped with the virtual memory API and cannot be
  exported with ``cudaIpcGetMemHandle`` (newer PyTorch exports it as a cuMem
  shareable handle instead, which a reader in another container or sandbox
  may be unable to import, with no fallback; relayd's pools use neither).
* **Cut into slots** by :class:`relayd_client.wire.slots.SlotAllocator`, the
  arena's allocator, and leased by :class:`relayd.pools.leases.LeaseManager`
  under the arena's rules (grants, generations, TTL, backpressure, reclaim):
  one implementation, two kinds of memory. A GPU pool has one "segment"
  (index 0); its runs carry ``pool="cuda:<uuid>"``.
* **Slot headers in shared memory.** Generations cannot live in GPU memory
  (reading one would be a device sync per get), so each pool has a small
  SHM segment of ``(generation, lease_id)`` headers, laid out like an arena
  segment's and named ``relayd.<node>.<epoch>.<1000 + n>``: the arena's
  prefix and lock, so a dead daemon's header segments are removed with its
  arena segments.
* **Exported once.** ``UntypedStorage._share_cuda_()`` is what
  ``torch.multiprocessing`` sends for a CUDA tensor; its tuple is
  ``(device, handle, storage_size_bytes, storage_offset_bytes,
  ref_counter_handle, ref_counter_offset, event_handle,
  event_sync_required)``. Everything but ``device`` goes into
  ``relayd.v1.CudaIpcHandle`` in the Attach reply; the GPU travels as its
  UUID because an ordinal means nothing in another process
  (``CUDA_VISIBLE_DEVICES`` remaps them). Clients open it once per process
  with ``UntypedStorage._new_shared_cuda`` on their own ordinal of that UUID.

Who calls what: :func:`open_pools` once from ``Daemon.startup``;
:func:`preflight` from :mod:`relayd.preflight` before that; the
:class:`CudaPool` methods from the lease manager on the event loop;
:meth:`CudaPool.close` once from ``Daemon.shutdown``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import TYPE_CHECKING, Any

from relayd_client.wire.cuda_ipc import (
    export_handle,
    forget_own_export,
    pool_name,
    register_own_export,
    uuid_of,
)
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.shm import HEADER_STRIDE, MappedSegment, data_offset_for
from relayd_client.wire.slots import SlotAllocator

from .arena import Run

if TYPE_CHECKING:
    from ..config import Settings

log = logging.getLogger(__name__)

# Header segments are numbered from here, after any plausible arena segment.
HEADER_SEGMENT_BASE = 1000


@dataclasses.dataclass(frozen=True, slots=True)
class PoolGeometry:
    """How a pool of ``pool_bytes`` is cut: whole slots only, at least one."""

    nslots: int
    slot_size: int

    @property
    def nbytes(self) -> int:
        return self.nslots * self.slot_size

    @property
    def header_bytes(self) -> int:
        # An arena-style segment whose "slots" are 16 bytes: headers, then a
        # data area nobody uses (16 bytes a slot: cheaper than a second layout).
        return data_offset_for(self.nslots) + self.nslots * HEADER_STRIDE


def pool_geometry(pool_bytes: int, slot_size: int) -> PoolGeometry:
    nslots = pool_bytes // slot_size
    if nslots < 1:
        raise ValueError(f"a GPU pool of {pool_bytes} bytes holds no slot of {slot_size}")
    return PoolGeometry(nslots, slot_size)


class CudaPool:
    """One GPU's slot pool: device memory, its allocator and its header segment.

    ``memory`` is the pool's uint8 tensor (None in tests that exercise the
    lease rules without a GPU); ``export`` is its IPC handle.
    """

    def __init__(
        self,
        *,
        uuid: str,
        device_index: int,
        geometry: PoolGeometry,
        headers: MappedSegment,
        memory: Any = None,
        export: pb.CudaIpcHandle | None = None,
    ) -> None:
        self.uuid = uuid
        self.name = pool_name(uuid)
        self.device_index = device_index
        self.slot_size = geometry.slot_size
        self.nslots = geometry.nslots
        self.allocator = SlotAllocator(geometry.nslots)
        self.headers = headers
        self.memory = memory
        self.export = export or pb.CudaIpcHandle()

    @classmethod
    def create(
        cls, device_index: int, *, pool_bytes: int, slot_size: int, prefix: str, mode: int = 0o600
    ) -> CudaPool:
        import torch

        geometry = pool_geometry(pool_bytes, slot_size)
        uuid = uuid_of(torch.cuda.get_device_properties(device_index))
        headers = MappedSegment(
            f"{prefix}.{HEADER_SEGMENT_BASE + device_index}",
            geometry.header_bytes,
            0,
            HEADER_STRIDE,
            create=True,
            mode=mode,
        )
        device = torch.device("cuda", device_index)
        try:
            with torch.cuda.device(device):
                memory = torch.empty(geometry.nbytes, dtype=torch.uint8, device=device)
                # Touch it once so a bad pool fails here, not in a client.
                memory[:1].zero_()
                torch.cuda.synchronize(device)
                storage: Any = memory.untyped_storage()
                export = export_handle(storage._share_cuda_())
        except BaseException:
            headers.close()
            headers.unlink()
            raise
        # A client in this very process cannot open the handle (CUDA IPC
        # refuses its own process's handles): it gets this tensor instead.
        register_own_export(export.handle, memory)
        return cls(
            uuid=uuid,
            device_index=device_index,
            geometry=geometry,
            headers=headers,
            memory=memory,
            export=export,
        )

    # -- what LeaseManager needs (relayd.pools.records.Pool) ---------------------------

    @property
    def capacity_slots(self) -> int:
        return self.nslots

    @property
    def free_slots(self) -> int:
        return self.allocator.free_slots

    @property
    def capacity_bytes(self) -> int:
        return self.nslots * self.slot_size

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_slots * self.slot_size

    def largest_free_run(self) -> int:
        return self.allocator.largest_free_run()

    def max_run_slots(self) -> int:
        return self.nslots

    def allocate(self, nslots: int) -> Run | None:
        slot = self.allocator.allocate(nslots)
        return None if slot is None else Run(0, slot, nslots, self.name)

    def free(self, run: Run) -> None:
        self.allocator.free(run.slot, run.nslots)

    def clear_header(self, segment: int, slot: int) -> None:
        self.headers.write_header(slot, 0, 0)

    def header(self, segment: int, slot: int) -> tuple[int, int]:
        return self.headers.read_header(slot)

    # -- wire and status ---------------------------------------------------------------

    def describe(self) -> pb.CudaPool:
        """What Attach tells a client about this pool."""
        return pb.CudaPool(
            name=self.name,
            gpu_uuid=self.uuid,
            nslots=self.nslots,
            slot_size=self.slot_size,
            storage=self.export,
            headers=pb.Segment(name=self.headers.name, size=self.headers.size, index=0),
        )

    def close(self) -> None:
        """Unlink the header segment and drop the device memory (once, at shutdown)."""
        self.headers.close()
        self.headers.unlink()
        if self.memory is not None:
            forget_own_export(self.export.handle)
            self.memory = None
            import torch

            # Clients may still hold the pool open; PyTorch keeps exported
            # memory in "limbo" until their refcounts drop, ipc_collect frees
            # what nobody holds any more.
            cuda: Any = torch.cuda
            cuda.ipc_collect()


def pool_status(pool: Any, lease_slots: int, granted_slots: int) -> dict[str, Any]:
    """One ``pools`` entry of ``Daemon.snapshot`` for the arena or a GPU pool."""
    return {
        "name": pool.name,
        "capacity_bytes": pool.capacity_bytes,
        "used_bytes": lease_slots * pool.slot_size,
        "granted_bytes": granted_slots * pool.slot_size,
        "largest_free_run_bytes": pool.largest_free_run() * pool.slot_size,
        "slot_size": pool.slot_size,
        "slots": pool.capacity_slots,
        "free_slots": pool.free_slots,
    }


def cuda_present() -> bool:
    """CUDA is usable here, without importing torch on a host with no NVIDIA driver."""
    from ..preflight import detect_cuda

    return detect_cuda()


def open_pools(settings: Settings, *, prefix: str, mode: int = 0o600) -> list[CudaPool]:
    """One pool per visible GPU; none when gpu_pool_size is 0 or CUDA is absent."""
    if settings.gpu_pool_size <= 0 or not cuda_present():
        return []
    import torch

    pools: list[CudaPool] = []
    try:
        for index in range(torch.cuda.device_count()):
            pool = CudaPool.create(
                index,
                pool_bytes=settings.gpu_pool_size,
                slot_size=settings.slot_size,
                prefix=prefix,
                mode=mode,
            )
            pools.append(pool)
            log.info(
                "GPU pool %s on cuda:%d: %d bytes in %d slots",
                pool.name,
                index,
                pool.capacity_bytes,
                pool.nslots,
            )
    except BaseException:
        for pool in pools:
            pool.close()
        raise
    matrix = peer_access_matrix()
    _PEERS.update(matrix)
    missing = sorted(f"{a[:12]}->{b[:12]}" for (a, b), ok in matrix.items() if not ok)
    if missing:
        log.info("no peer access between %s: those edges stage through shm", ", ".join(missing))
    return pools


# PF_EXITING in /proc/<pid>/stat's flags: set when a process starts to exit,
# before its file descriptors (its session socket, its CUDA device) close.
_PF_EXITING = 0x4


def gpu_work_may_run(pid: int, proc: str = "/proc") -> bool:
    """For :class:`relayd.pools.leases.LeaseManager`: can process ``pid``, whose
    session has ended, still have GPU work running?

    Only while it is exiting (a killed writer's queued copies run until its
    CUDA context is torn down, after its socket closed). A process that is
    gone or a zombie has no context left; one that lives on closed its
    session itself, and a client settles its copies before it does. An
    unknown pid (0: another pid namespace) cannot be watched.
    """
    if pid <= 0:
        return False
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    fields = stat.rpartition(b")")[2].split()
    if len(fields) < 7 or fields[0] in (b"Z", b"X", b"x"):
        return False
    return bool(int(fields[6]) & _PF_EXITING)


# Probed once at start by open_pools; what the router asks per GPU pair.
_PEERS: dict[tuple[str, str], bool] = {}


def peer_access(src_uuid: str, dst_uuid: str) -> bool:
    """For ``relayd.routing.router.route``: can GPU ``dst`` read ``src`` directly?

    Answers from the matrix probed when the pools were made; without GPU
    pools it knows no pair, and an unknown pair stages through shm.
    """
    return src_uuid == dst_uuid or _PEERS.get((src_uuid, dst_uuid), False)


@functools.cache
def peer_access_matrix() -> dict[tuple[str, str], bool]:
    """``(src_uuid, dst_uuid) -> can dst read src directly``, probed once per GPU pair."""
    import torch

    n = torch.cuda.device_count()
    uuids = [uuid_of(torch.cuda.get_device_properties(i)) for i in range(n)]
    return {
        (uuids[src], uuids[dst]): bool(torch.cuda.can_device_access_peer(dst, src))
        for src in range(n)
        for dst in range(n)
        if src != dst
    }


def preflight(settings: Settings) -> str | None:
    """GPU pools can be made here: CUDA works, IPC export is possible, memory fits."""
    if settings.gpu_pool_size <= 0:
        return None
    conf = ",".join(
        os.environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    )
    conf = conf.replace(" ", "").lower()
    if "expandable_segments:true" in conf:
        return (
            "PYTORCH_CUDA_ALLOC_CONF enables expandable_segments, whose memory cannot be "
            "exported over CUDA IPC; unset it for relayd (stages may keep it)"
        )
    if "backend:cudamallocasync" in conf:
        # CUDAMallocAsyncAllocator::shareIpcHandle is not implemented.
        return (
            "PYTORCH_CUDA_ALLOC_CONF selects backend:cudaMallocAsync, whose memory cannot be "
            "exported over CUDA IPC; unset it for relayd"
        )
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return "gpu_pool_size is set but torch sees no CUDA device; use --gpu-pool-size 0"
    try:
        pool_geometry(settings.gpu_pool_size, settings.slot_size)
        for index in range(torch.cuda.device_count()):
            free, _total = torch.cuda.mem_get_info(index)
            if free < settings.gpu_pool_size:
                return (
                    f"GPU {index} has {free} bytes free, less than gpu_pool_size "
                    f"({settings.gpu_pool_size}); lower --gpu-pool-size"
                )
        peer_access_matrix()
    except (RuntimeError, ValueError) as exc:
        return f"GPU pools cannot be set up: {exc}"
    return None
