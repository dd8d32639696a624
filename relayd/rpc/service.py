"""The ``relayd.v1.Relay`` gRPC service: attach, grants, abort, fetch, status, drain.

Route and the socket fallback are :mod:`relayd.rpc.routing`'s. The service
holds the parts it calls, each given by the daemon when it wires itself
(:mod:`relayd.server`); the peer layer is added once it runs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeAlias

from relayd_client.wire.errors import (
    InvalidArgumentError,
    PermissionDeniedError,
    SessionClosedError,
    VersionMismatchError,
)
from relayd_client.wire.names import MAX_SESSION_STAGES, check_request_id, check_stage
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.proto import relay_pb2_grpc as pb_grpc
from relayd_client.wire.shm import HEADER_STRIDE, SHM_POOL
from relayd_client.wire.version import PROTOCOL_VERSION

from ..keys import KeyIndex
from ..pools.arena import Arena
from ..pools.leases import LeaseManager
from ..pools.reclaim import Aborter
from ..pools.sessions import SessionState
from ..routing.topology import Topology
from .admission import Roles
from .deadlines import give_back_if_too_late, within_deadline
from .errors import mapped
from .fetch import Fetcher
from .routing import RoutingService

log = logging.getLogger(__name__)

MAX_GRANT_BYTES = 1 << 40
MAX_DRAIN_GRACE = 3600.0
MAX_UNBOUND_SESSIONS = 64
# grpc ships no type stubs; the servicer context is untyped.
Ctx: TypeAlias = Any


def _make_room_for_attach(m: LeaseManager) -> None:
    """Keep at most MAX_UNBOUND_SESSIONS sessions waiting for their bind.

    gRPC does not say who attaches, so an Attach flood cannot be charged to a
    uid; instead the oldest unbound session gives way. A real client binds
    within milliseconds of its Attach, so the sessions that give way are the
    flood's own, and --max-sessions stays free for clients that bind.
    """
    pending = [s for s in m.sessions.values() if s.state is SessionState.PENDING]
    for stale in sorted(pending, key=lambda s: s.created)[
        : len(pending) - MAX_UNBOUND_SESSIONS + 1
    ]:
        log.info("unbound session dropped for a newer attach", extra={"session_id": stale.id})
        m.close_session(stale.id)


@dataclasses.dataclass(frozen=True)
class NodeFacts:
    """What every Attach tells a client about this daemon, fixed at start."""

    node_id: str
    epoch: str
    session_socket: str
    pin_host_memory: str
    lease_ttl: float
    peer_address: str


class GpuPool(Protocol):
    def describe(self) -> pb.CudaPool: ...


class RemoteSession(Protocol):
    @property
    def session_id(self) -> str: ...


class ServicePeers(Protocol):
    """The peer layer as this service sees it (``peers.PeerManager``)."""

    @property
    def transport(self) -> RemoteSession: ...
    async def abort_remote(
        self,
        request_id: str,
        stages: tuple[str, ...] = (),
        narrow: bool = False,
        by: Aborter | None = None,
    ) -> int: ...


class Lifecycle(Protocol):
    """The daemon's stop, as Drain asks for it (``server.Daemon``)."""

    @property
    def drain_grace(self) -> float: ...
    def request_stop(self, *, grace: float | None = None) -> None: ...


class RelayService(RoutingService, pb_grpc.RelayServicer):
    def __init__(
        self,
        leases: LeaseManager,
        *,
        facts: NodeFacts,
        reserve_timeout: float,
        arena: Arena,
        gpu_pools: Sequence[GpuPool],
        topology: Topology,
        keys: KeyIndex,
        fetcher: Fetcher,
        status: Callable[[], pb.StatusResponse],
        roles: Roles,
        lifecycle: Lifecycle,
        on_ref: Callable[[int], None],
    ) -> None:
        self.leases = leases
        self.facts = facts
        self.reserve_timeout = reserve_timeout
        self.arena = arena
        self.gpu_pools = gpu_pools
        self.topology = topology
        self.keys = keys
        self.fetcher = fetcher
        self.status = status
        self.roles = roles
        self.lifecycle = lifecycle
        self.on_ref = on_ref
        self.peers: ServicePeers | None = None
        """Set once the peer layer runs (``--peer-address``)."""

    @mapped
    async def Attach(self, request: pb.AttachRequest, context: Ctx) -> pb.AttachResponse:
        if request.protocol_version != PROTOCOL_VERSION:
            raise VersionMismatchError(
                f"client speaks relayd protocol {request.protocol_version}, this daemon speaks "
                f"{PROTOCOL_VERSION}; upgrade the older side"
            )
        if not request.stages or len(request.stages) > MAX_SESSION_STAGES:
            raise InvalidArgumentError(f"attach needs 1 to {MAX_SESSION_STAGES} stage names")
        stages = [check_stage(s, "stage") for s in request.stages]
        if len(request.gpu_uuids) > 64 or len(request.namespaces) > 8:
            raise InvalidArgumentError("too many GPUs or namespaces in attach")
        facts = self.facts
        _make_room_for_attach(self.leases)
        session = self.leases.open_session(
            pid=request.pid,
            stages=stages,
            namespaces={k[:16]: v[:64] for k, v in request.namespaces.items()},
            gpu_uuids=[u[:64] for u in request.gpu_uuids],
        )
        arena = self.arena
        return pb.AttachResponse(
            protocol_version=PROTOCOL_VERSION,
            session_id=session.id,
            session_token=session.token,
            session_socket=facts.session_socket,
            node_id=facts.node_id,
            daemon_epoch=facts.epoch,
            slot_size=arena.slot_size,
            header_offset=0,
            header_stride=HEADER_STRIDE,
            data_offset=arena.segments[0].data_offset,
            segments=[pb.Segment(name=s.name, size=s.size, index=s.index) for s in arena.segments],
            default_grant_bytes=self.leases.grant_slots * arena.slot_size,
            cuda_pools=[p.describe() for p in self.gpu_pools],
            pin_host_memory=facts.pin_host_memory,
            lease_ttl_seconds=facts.lease_ttl,
            peer_address=facts.peer_address,
            probe_offset=self.topology.probe_offset,
            mooncake_session=self.peers.transport.session_id if self.peers is not None else "",
            reserve_publishes=True,
            compact_refs=True,
            reserve_over_read=True,
        )

    @mapped
    async def Grant(self, request: pb.GrantRequest, context: Ctx) -> pb.GrantResponse:
        m = self.leases
        session = m.authenticate(request.session_id, request.session_token)
        if session.state is not SessionState.BOUND:
            raise SessionClosedError("bind the session socket before asking for grants")
        if request.min_bytes > MAX_GRANT_BYTES:
            raise InvalidArgumentError(f"min_bytes {request.min_bytes} is absurd")
        # --reserve-timeout is the longest any grant waits: a client asking for
        # more (or for inf) would hold its place in the fair queue for as long.
        limit = self.reserve_timeout
        timeout = min(request.timeout_seconds, limit) if request.timeout_seconds > 0 else limit
        timeout = within_deadline(timeout, context)
        grant = await m.grant(session, request.min_bytes, timeout, request.pool or SHM_POOL)
        # Served, but maybe resumed too late (a busy loop) for the answer to arrive: the
        # server's deadline (the client's timeout from the request's arrival) comes no
        # sooner than the client's. Taken back then as its ReturnGrant would.
        give_back_if_too_late(
            context, "grant", f"grant {grant.id} taken back", session.id,
            lambda: m.return_grant(session, grant.id),
        )  # fmt: skip
        # Once this returns, gRPC tells the handler nothing of the answer's fate: the
        # aio context's cancelled() reports only a status the handler set, and its done
        # callbacks run whether the answer was written or failed. An answer written in
        # time but received after the client's deadline (a stalled client) leaves the
        # grant held until the session closes, as is every grant the session holds.
        return pb.GrantResponse(
            pool=grant.run.pool,
            grant_id=grant.id,
            segment=grant.run.segment,
            slot=grant.run.slot,
            nslots=grant.run.nslots,
            generation_base=m.new_generation_base(grant),
        )

    @mapped
    async def Abort(self, request: pb.AbortRequest, context: Ctx) -> pb.AbortResponse:
        session = self._bound(request.session_id, request.session_token)
        check_request_id(request.request_id)
        vouched = self.leases.check_abort(session.stages, request.request_id)
        # Narrowed to the session's stages when others' uids wrote the request here.
        narrow = self.leases.narrowed_to(session, request.request_id)
        n, nbytes = self.leases.abort_request(request.request_id, narrow)
        self.keys.abort(request.request_id, session.stages)
        if self.peers is not None:
            # abort frees the request on every node; peers never propagate it further.
            # A request unknown here could be any stage's there: they judge the stages.
            stages = () if vouched and narrow is None else session.stages
            by = Aborter(session.uid, session.stages)  # each peer narrows by its own writers
            n += await self.peers.abort_remote(request.request_id, stages, narrow is not None, by)
        return pb.AbortResponse(leases_freed=n, bytes_freed=nbytes)

    @mapped
    async def Fetch(self, request: pb.FetchRequest, context: Ctx) -> pb.FetchResponse:
        """Cross-node read: pull a foreign DataRef into this arena (see relayd.peers).
        Clients use the session socket's FetchCall; this is the same work over gRPC."""
        m = self.leases
        session = m.authenticate(request.session_id, request.session_token)
        timeout = within_deadline(self.fetcher.timeout(request.timeout_seconds), context)
        fetched = await self.fetcher.fetch(session, request.data_ref, timeout)
        # Pulled, but maybe resumed too late (as for Grant): released then as the
        # reader's Release would. (A FetchCall on the session socket has no deadline
        # here: its client releases an answer that comes after it gave up.)
        lease = fetched.lease

        def release() -> None:
            m.on_release(session, lease)
            m.flush()

        give_back_if_too_late(
            context, "fetch", f"fetched lease {lease.lease_id} released", session.id, release
        )
        return fetched

    @mapped
    async def Status(self, request: pb.StatusRequest, context: Ctx) -> pb.StatusResponse:
        session = self._bound(request.session_id, request.session_token)
        resp = self.status()
        if session.id not in self.roles.admins:
            # Who runs what (pids, uids, sessions, request ids) is the operator's to see.
            for field in ("leases", "sessions", "stages"):
                resp.ClearField(field)
        return resp

    @mapped
    async def Drain(self, request: pb.DrainRequest, context: Ctx) -> pb.DrainResponse:
        session = self._bound(request.session_id, request.session_token)
        if session.id not in self.roles.admins:
            raise PermissionDeniedError(
                "only root, the daemon's own uid and members of --admin-gid may drain relayd"
            )
        grace = request.grace_seconds if request.grace_seconds > 0 else None
        if grace is not None and not grace <= MAX_DRAIN_GRACE:
            raise InvalidArgumentError(f"grace_seconds must be at most {MAX_DRAIN_GRACE:g}")
        self.lifecycle.request_stop(grace=grace)
        return pb.DrainResponse(accepted=True, grace_seconds=self.lifecycle.drain_grace)
