"""The client's GPU side: one client's GPU state, and how it carries out a GPU route.

The GPU paths live in modules of their own: :mod:`._cuda_facts` (GPU identity,
what a payload holds), :mod:`._cuda_pool` (cuda_ipc_pool),
:mod:`._cuda_direct` (cuda_ipc_direct), :mod:`._cuda_staging` (pinning and
the shm path's restore onto a GPU), :mod:`._cuda_copy` (what they share) and
:mod:`._gpu_order` (stream and event ordering, without torch).

The route. The daemon's router picks the transport from both ends'
placements (it knows the reader's GPUs from its Attach and the peer-access
matrix it probed once per GPU pair); the client sends the payload's GPU
UUIDs with its Route request and :func:`carry_out_route` carries the
answer out, or falls back along the router's own order where this client
cannot. A process reports the GPU it works
on at Attach only if it has initialized CUDA by then: open the client after
picking the device, or the edge is routed as GPU -> CPU (through shm, still
correct: CUDA leaves are restored on the reader's GPU).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from typing import Any

from . import _gpu_order
from ._cuda_facts import PayloadGpuFacts, leaf_gpu, payload_facts, uses_cuda
from ._cuda_pool import forget_pools, import_pool
from ._cuda_staging import pin_host, unpin_host
from .wire.errors import CorruptRefError, PeerUnavailableError
from .wire.proto import relay_pb2 as pb
from .wire.transport import DIRECT_META_LIMIT, Transport

log = logging.getLogger(__name__)

# The transports a GPU path carries, in the router's order of preference.
GPU_TRANSPORTS = (Transport.CUDA_IPC_DIRECT, Transport.CUDA_IPC_POOL)


def carry_out_route(
    facts: PayloadGpuFacts, *, pools: Collection[str], daemon_route: Transport
) -> Transport:
    """The transport this client uses for a put the router routed ``daemon_route``.

    The router (``relayd.routing.router.route``) decides the transport; this
    only says whether this client can carry the decision out and, where it
    cannot, takes the router's next row: cuda_ipc_direct falls back to
    cuda_ipc_pool, cuda_ipc_pool to shm. It never answers a transport the
    router ranks above ``daemon_route``, and any other route is not a GPU
    path here (shm).

    What the router cannot know, deciding once per edge from the Route
    request: whether this payload's handles fit the DataRef (measured per
    payload; the request carries an estimate per edge), and that one lease
    lives in one GPU pool, so a pooled payload must sit on one GPU that has
    a pool. A payload no GPU path can carry (no CUDA tensor, a CPU tensor
    among them, a GPU named by ordinal) takes shm; the router already routes
    those to shm, so this matters only for a transport pinned with
    :attr:`GpuSide.force`.
    """
    src = facts.cuda_uuids
    if not src or "" in src or facts.has_cpu_tensors:
        return Transport.SHM
    carried = daemon_route
    if carried is Transport.CUDA_IPC_DIRECT and facts.direct_meta_bytes > DIRECT_META_LIMIT:
        carried = Transport.CUDA_IPC_POOL
    if carried is Transport.CUDA_IPC_POOL and not one_pool_holds(src, pools):
        carried = Transport.SHM
    return carried if carried in GPU_TRANSPORTS else Transport.SHM


def one_pool_holds(gpus: Sequence[str], pools: Collection[str]) -> bool:
    """A pool lease can hold a payload on ``gpus``: one GPU, and it has a pool."""
    return len(gpus) == 1 and gpus[0] in pools


# Events of a closed client's published pool leases, kept until the time
# given (a reader may have opened one already; see ``_cuda_pool``).
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
        # pool name -> (the pool imported into this process, its slot size)
        self._imported: dict[str, tuple[Any, int]] = {}
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

    def facts(self, specs: Sequence[Any], header_bytes: int) -> PayloadGpuFacts | None:
        """What a put's layout holds for the GPU paths; None without a CUDA leaf."""
        devices = [s.device for s in specs if s.nbytes]
        if not any(leaf_gpu(d) is not None for d in devices):
            return None
        self.ensure_pinned()  # CUDA is in use now, if it was not at attach
        return payload_facts(devices, header_bytes)

    def route(self, facts: PayloadGpuFacts, daemon_route: Transport) -> Transport:
        return carry_out_route(
            facts, pools=self.pools.keys(), daemon_route=self.force or daemon_route
        )

    def has_pool_for(self, facts: PayloadGpuFacts) -> bool:
        return one_pool_holds(facts.cuda_uuids, self.pools)

    def fits(self, pool: str, slot: int, nslots: int) -> bool:
        desc = self.by_name.get(pool)
        return desc is not None and slot + nslots <= desc.nslots

    def pool_region(self, pool: str, slot: int, nbytes: int) -> Any:
        imported = self._imported.get(pool)
        if imported is None:  # a GpuSide lives for one daemon epoch: its pools do too
            desc = self.by_name[pool]
            imported = self._imported[pool] = (
                import_pool(desc, self.node_id, self.epoch),
                desc.slot_size,
            )
        tensor, slot_size = imported
        start = slot * slot_size
        return tensor[start : start + nbytes]

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
        self._imported.clear()
        self.fences.cancel()
        _linger(list(self.fences.events.values()), time.monotonic())
        self.fences.events.clear()
        self._views.clear()
