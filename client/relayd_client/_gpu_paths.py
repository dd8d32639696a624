"""The GPU paths of a put and a get, on top of :mod:`_cuda`.

A put whose leaves are all CUDA tensors may go as PyTorch storage handles in
the DataRef (``cuda_ipc_direct``, no lease; only where the writer opted in)
or through a lease of the source GPU's pool (``cuda_ipc_pool``: a copy on
the caller's stream, an IPC event in the DataRef, the Publish sent at once);
:meth:`_cuda.GpuSide.route` picks between them and shm. A get of either
waits on the writer's event (pool) or opens the handles once per process
(direct).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import _cuda_direct, _cuda_facts, _cuda_pool, _packing
from ._aborts import AbortedRequests
from ._checks import ReadChecks, layout_specs
from ._notices import Notices
from ._reports import Reports
from ._writer import planned_here, restarted_error
from .wire.dataref import DataRef
from .wire.errors import (
    CorruptRefError,
    DrainingError,
    PeerUnavailableError,
    SessionClosedError,
    StaleRefError,
)
from .wire.proto import relay_pb2 as pb
from .wire.transport import DIRECT_META_LIMIT, Transport

if TYPE_CHECKING:
    from ._connection import Connection
    from ._writer import PutPlan


class GpuPaths:
    """GPU puts and gets of one client (nothing happens without a ``GpuSide``)."""

    def __init__(
        self,
        conn: Connection,
        checks: ReadChecks,
        notices: Notices,
        aborts: AbortedRequests,
        reports: Reports,
    ) -> None:
        self._conn = conn
        self._checks = checks
        self._notices = notices
        self._aborts = aborts
        self._reports = reports

    def may_take(self, plan: PutPlan) -> bool:
        """Whether a GPU path may take this put: CUDA leaves, no forwarded refs."""
        return self._conn.gpu is not None and not plan.refs and bool(plan.cuda_uuids)

    async def put(
        self, plan: PutPlan, timeout: float | None, route: int, streams: Sequence[Any] = ()
    ) -> DataRef | None:
        """A GPU transport for this put, or None when it goes through shm.

        ``streams``: the producer's current streams when this runs on another
        thread than the producer's (the blocking client's loop thread).
        """
        msg, tensors, specs, total = plan.msg, plan.tensors, plan.specs, plan.total
        conn = self._conn
        gpu = conn.gpu
        if gpu is None or conn.socket_fallback:
            return None
        facts = gpu.facts(specs, len(msg.header))
        if facts is None:  # no CUDA leaf: the arena
            return None
        transport = gpu.route(facts, Transport.from_proto(route))
        if transport is Transport.SHM:
            return None
        if conn.draining:
            raise DrainingError("relayd is draining; no new transfers")
        if transport is Transport.CUDA_IPC_DIRECT and self._put_direct(
            msg, tensors, specs, streams
        ):
            self._reports.transfer(pb.TRANSPORT_CUDA_IPC_DIRECT, total, msg.to_stage)
            return DataRef(msg)
        if not gpu.has_pool_for(facts):
            return None
        deadline = time.monotonic() + conn.rpc_timeout(timeout)
        return await self._put_pool(plan, deadline, streams)

    def _put_direct(
        self, msg: pb.DataRef, tensors: list[Any], specs: list[Any], streams: Sequence[Any] = ()
    ) -> bool:
        """cuda_ipc_direct: storage handles in the DataRef; False if they do not fit."""
        # None: PyTorch will not re-export memory it imported over CUDA IPC (a
        # stage forwarding a zero-copy get) or memory of an allocator without
        # IPC (cudaMallocAsync); the pool path copies it instead.
        handles = _cuda_direct.export_all_direct(tensors, specs, streams=streams)
        if handles is not None:
            for layout, spec, h in zip(msg.tensors, specs, handles, strict=True):
                layout.device = spec.device
                if h is not None:
                    layout.cuda_ipc.CopyFrom(h)
            msg.transport = pb.TRANSPORT_CUDA_IPC_DIRECT
            if msg.ByteSize() <= DIRECT_META_LIMIT:
                return True
            for h in handles:  # too big after all: the counts taken go back
                if h is not None and h.ref_counter_handle:
                    _cuda_direct.release_counter(h)
        msg.transport = pb.TRANSPORT_UNSPECIFIED
        for layout in msg.tensors:
            layout.ClearField("cuda_ipc")
        return False

    async def _put_pool(
        self, plan: PutPlan, deadline: float, streams: Sequence[Any] = ()
    ) -> DataRef:
        """cuda_ipc_pool: copy into a lease of the source GPU's pool, event in the DataRef."""
        msg, tensors, specs, total = plan.msg, plan.tensors, plan.specs, plan.total
        conn = self._conn
        gpu = conn.gpu
        assert gpu is not None
        source = _cuda_facts.leaf_gpu(next(s.device for s in specs if s.nbytes))
        desc = gpu.pools[source or ""]
        lease = await conn.grants.reserve(total, deadline, desc.name)
        self._notices.reserve(lease, msg.request_id, msg.to_stage)
        if conn.gpu is not gpu or not planned_here(plan, conn.attach):
            # The daemon restarted while the lease was waited for: the lease is the
            # new daemon's, but the pools mapped above and the DataRef's epoch are
            # the old one's. The copy would land in memory no reader maps, under a
            # DataRef every reader refuses as stale.
            self._notices.cancel(lease)
            raise restarted_error()
        try:
            region = gpu.pool_region(desc.name, lease.slot, total)
            event, handle = _cuda_pool.write_pool(region, tensors, specs, streams)
            gpu.keep_event(lease.id, event)
            self._aborts.check(msg.request_id)
        except BaseException:
            self._notices.cancel(lease)
            raise
        # The copy may still run: the header only names the lease, the event orders the bytes.
        gpu.headers[desc.name].write_header(lease.slot, lease.id, total)
        for layout, spec in zip(msg.tensors, specs, strict=True):
            layout.device = spec.device
        msg.transport = pb.TRANSPORT_CUDA_IPC_POOL
        msg.cuda_event = handle
        msg.lease.CopyFrom(
            pb.LeaseRef(
                pool=desc.name,
                segment=0,
                slot=lease.slot,
                nslots=lease.nslots,
                offset=lease.slot * desc.slot_size,
                length=total,
                generation=lease.id,
                lease_id=lease.id,
            )
        )
        # Sent now, not lingering: the frame also has the daemon take the
        # readers' Release rings, so the slots of the leases read since come
        # back to this writer at its next put.
        self._notices.publish(lease, total, pb.TRANSPORT_CUDA_IPC_POOL, now=True)
        return DataRef(msg)

    async def get(self, m: pb.DataRef, transport: Transport, copy: bool) -> list[Any]:
        gpu = self._conn.gpu
        if gpu is None:
            raise SessionClosedError("RelayClient is not open")
        if transport is Transport.CUDA_IPC_DIRECT:
            if m.origin.node_id != gpu.node_id:
                raise PeerUnavailableError("direct CUDA IPC DataRefs cannot leave their node")
            specs = layout_specs(m)
            _packing.validate_layout(specs, max((s.offset + s.nbytes for s in specs), default=0))
            if any(_cuda_facts.leaf_gpu(s.device) is None for s in specs if s.nbytes):
                raise CorruptRefError("a direct CUDA IPC DataRef holds a CPU tensor")
            handles = [t.cuda_ipc for t in m.tensors]
            # A second read would give PyTorch's IPC count back twice (freeing early).
            key = (m.origin.daemon_epoch, m.object_id)
            gpu.direct_reads.claim(key, "this direct CUDA IPC DataRef")
            deadline = time.monotonic() + self._conn.timeout
            return await _cuda_direct.read_direct(specs, handles, copy, deadline)
        specs = self._checks.checked_specs(m, m.lease.length)
        self._checks.check_not_released(m, self._conn.require_open().daemon_epoch)
        try:
            seg, region = gpu.lease_region(m)
        except StaleRefError:
            self._aborts.check(m.request_id)
            raise
        # No Claim: the copy is queued on the GPU and waited for within this
        # call, a short read like an arena copy below OFFLOAD_BYTES, so its
        # Release alone tells the daemon (through the Release ring: no frame,
        # no wake-up on the reader's path). A lease the writer's death takes
        # meanwhile fails the generation check below.
        try:
            deadline = time.monotonic() + self._conn.timeout
            tensors = await _cuda_pool.read_pool(region, specs, bytes(m.cuda_event), deadline)
        except BaseException:
            # Nothing usable was read (e.g. the writer died before its event
            # could be opened): the lease goes back now, not at its TTL.
            self._notices.release(m)
            raise
        if seg.read_header(m.lease.slot)[0] != m.lease.generation:
            raise StaleRefError("the lease was reclaimed while it was being read; data discarded")
        self._notices.release(m)
        return tensors
