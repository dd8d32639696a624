"""The daemon's state as ``relayd status`` and the metrics' scrape see it.

Both read the same domain objects: the lease table, the pools, the registry,
the per-edge stats, the transfer and reclaim tallies (:mod:`relayd.counts`)
and the peers. :meth:`NodeStatus.snapshot` is what the scrape-time collector
reads (:class:`relayd.metrics.StateCollector`); :meth:`NodeStatus.status`
builds the ``StatusResponse`` from it and from the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from relayd_client.wire.latency import BOUNDS as LATENCY_BOUNDS
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.shm import SHM_POOL

from . import __version__
from .counts import ReclaimCounts, TransferCounts
from .edges import EdgeStats
from .pools import cuda as cuda_pools
from .pools.arena import Arena
from .pools.leases import LeaseManager
from .routing.topology import Topology
from .rpc.admission import Roles

# The longest lease list a status reply carries (oldest first).
MAX_STATUS_LEASES = 1000
# How long a scrape on the metrics thread waits for the event loop's snapshot.
SNAPSHOT_TIMEOUT_S = 5.0


class DaemonState(enum.Enum):
    """Where the daemon is in its lifecycle; one to one with ``relayd.v1.DaemonState``."""

    STARTING = pb.DAEMON_STATE_STARTING
    SERVING = pb.DAEMON_STATE_SERVING
    DRAINING = pb.DAEMON_STATE_DRAINING
    STOPPED = pb.DAEMON_STATE_STOPPED


class PeerView(Protocol):
    """What status and the metrics read of the peer layer (``peers.PeerManager``)."""

    def snapshot(self) -> dict[str, dict[str, float]]: ...
    def status(self) -> list[pb.PeerStatus]: ...


class NodeStatus:
    def __init__(
        self,
        *,
        node_id: str,
        epoch: str,
        started: float,
        state: Callable[[], DaemonState],
        leases: LeaseManager,
        arena: Arena,
        gpu_pools: Sequence[cuda_pools.CudaPool],
        topology: Topology,
        edges: EdgeStats,
        transfers: TransferCounts,
        reclaims: ReclaimCounts,
        roles: Roles,
    ) -> None:
        self.node_id = node_id
        self.epoch = epoch
        self.started = started
        self.state = state
        self.leases = leases
        self.arena = arena
        self.gpu_pools = gpu_pools
        self.topology = topology
        self.edges = edges
        self.transfers = transfers
        self.reclaims = reclaims
        self.roles = roles
        self.peers: PeerView | None = None
        """Set once the peer layer runs (``--peer-address``)."""

    def snapshot_threadsafe(self, loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
        """:meth:`snapshot` from any thread: scrapes run on the HTTP thread, the state
        belongs to ``loop``."""
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is loop:
                return self.snapshot()

        async def snap() -> dict[str, Any]:
            return self.snapshot()

        return asyncio.run_coroutine_threadsafe(snap(), loop).result(timeout=SNAPSHOT_TIMEOUT_S)

    def snapshot(self) -> dict[str, Any]:
        """Occupancy, lease counts, sessions and peers, as plain values."""
        m, a = self.leases, self.arena
        return {
            "pools": [
                {
                    "name": SHM_POOL,
                    "capacity_bytes": a.capacity_bytes,
                    "used_bytes": m.lease_slots() * a.slot_size,
                    "granted_bytes": m.granted_slots() * a.slot_size,
                    "largest_free_run_bytes": a.largest_free_run() * a.slot_size,
                    "slot_size": a.slot_size,
                    "slots": a.capacity_slots,
                    "free_slots": a.free_slots,
                }
            ]
            + [
                cuda_pools.pool_status(p, m.lease_slots(p.name), m.granted_slots(p.name))
                for p in self.gpu_pools
            ],
            "leases": {(SHM_POOL, st.name.lower()): n for st, n in m.leases_by_state().items()}
            | {
                (p.name, st.name.lower()): n
                for p in self.gpu_pools
                for st, n in m.leases_by_state(p.name).items()
            },
            "sessions": len(m.sessions) - len(self.roles.operators),
            "freed": {"ring": m.freed.by_ring, "frame": m.freed.by_frame},
            "released": {"ring": m.releases.by_ring, "frame": m.releases.by_frame},
            "serving": 1 if self.state() is DaemonState.SERVING else 0,
            **self.transfers.snapshot(),
            **(self.peers.snapshot() if self.peers is not None else {}),
        }

    def status(self) -> pb.StatusResponse:
        """The full reply; the service strips what only operators may see."""
        m = self.leases
        now = time.monotonic()
        snap = self.snapshot()
        resp = pb.StatusResponse(
            node_id=self.node_id,
            daemon_epoch=self.epoch,
            state=self.state().value,
            uptime_seconds=now - self.started,
            version=__version__,
        )
        for p in snap["pools"]:
            resp.pools.append(pb.PoolStatus(**p))
        for (_pool, state), n in snap["leases"].items():
            resp.leases_by_state[state] += n  # summed over the arena and GPU pools
        leases = sorted(m.leases.values(), key=lambda lease: lease.created)
        for lease in leases[:MAX_STATUS_LEASES]:
            resp.leases.append(
                pb.LeaseStatus(
                    lease_id=lease.id,
                    state=f"LEASE_STATE_{lease.state.name}",
                    pool=lease.run.pool,
                    bytes=lease.nbytes or lease.run.nslots * self.arena.slot_size,
                    request_id=lease.request_id,
                    from_stage=lease.from_stage,
                    to_stage=lease.to_stage,
                    age_seconds=now - lease.created,
                    session_id=lease.writer,
                )
            )
        for s in m.sessions.values():
            if s.id in self.roles.operators:
                continue
            resp.sessions.append(
                pb.SessionStatus(
                    session_id=s.id,
                    pid=s.pid,
                    stages=list(s.stages),
                    granted_bytes=s.granted_slots * self.arena.slot_size,
                    leases=sum(len(g.leases) for g in s.grants.values()),
                    age_seconds=now - s.created,
                    uid=max(s.uid, 0),
                )
            )
        resp.transfers_by_transport.update(
            {t: n for t, n in self.transfers.by_transport.items() if n}
        )
        if self.peers is not None:
            resp.peers.extend(self.peers.status())
        resp.reclaimed_by_reason.update({r: n for r, n in self.reclaims.by_reason.items() if n})
        self.topology.fill_status(resp)
        resp.edge_traffic.extend(self.edges.status())
        resp.latency_bucket_bounds.extend(LATENCY_BOUNDS)
        return resp


__all__ = ["DaemonState", "NodeStatus", "PeerView"]
