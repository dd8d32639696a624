"""The ``relayd.v1.Relay`` gRPC service: attach, grants, abort, status, drain."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, TypeAlias

from relayd_client.wire.errors import (
    InvalidArgumentError,
    PermissionDeniedError,
    SessionClosedError,
    VersionMismatchError,
)
from relayd_client.wire.names import check_request_id, check_stage
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.proto import relay_pb2_grpc as pb_grpc
from relayd_client.wire.shm import HEADER_STRIDE, SHM_POOL
from relayd_client.wire.version import PROTOCOL_VERSION

from ..pools.leases import LeaseManager
from ..pools.sessions import SessionState
from .errors import mapped
from .routing import RoutingService

if TYPE_CHECKING:
    from ..server import Daemon

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


class RelayService(RoutingService, pb_grpc.RelayServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    @mapped
    async def Attach(self, request: pb.AttachRequest, context: Ctx) -> pb.AttachResponse:
        if request.protocol_version != PROTOCOL_VERSION:
            raise VersionMismatchError(
                f"client speaks relayd protocol {request.protocol_version}, this daemon speaks "
                f"{PROTOCOL_VERSION}; upgrade the older side"
            )
        if not request.stages or len(request.stages) > 16:
            raise InvalidArgumentError("attach needs 1 to 16 stage names")
        stages = [check_stage(s, "stage") for s in request.stages]
        if len(request.gpu_uuids) > 64 or len(request.namespaces) > 8:
            raise InvalidArgumentError("too many GPUs or namespaces in attach")
        d = self.daemon
        _make_room_for_attach(d.manager)
        session = d.manager.open_session(
            pid=request.pid,
            stages=stages,
            namespaces={k[:16]: v[:64] for k, v in request.namespaces.items()},
            gpu_uuids=[u[:64] for u in request.gpu_uuids],
        )
        arena = d.arena
        return pb.AttachResponse(
            protocol_version=PROTOCOL_VERSION,
            session_id=session.id,
            session_token=session.token,
            session_socket=d.settings.session_socket,
            node_id=d.settings.node_id,
            daemon_epoch=d.epoch,
            slot_size=arena.slot_size,
            header_offset=0,
            header_stride=HEADER_STRIDE,
            data_offset=arena.segments[0].data_offset,
            segments=[pb.Segment(name=s.name, size=s.size, index=s.index) for s in arena.segments],
            default_grant_bytes=d.manager.grant_slots * arena.slot_size,
            cuda_pools=[p.describe() for p in d.cuda_pools],
            pin_host_memory=d.settings.pin_host_memory,
            lease_ttl_seconds=d.settings.lease_ttl,
            peer_address=d.settings.peer_address,
            probe_offset=d.topology.probe_offset,
            mooncake_session=d.peers.transport.session_id if d.peers is not None else "",
        )

    @mapped
    async def Grant(self, request: pb.GrantRequest, context: Ctx) -> pb.GrantResponse:
        m = self.daemon.manager
        session = m.authenticate(request.session_id, request.session_token)
        if session.state is not SessionState.BOUND:
            raise SessionClosedError("bind the session socket before asking for grants")
        if request.min_bytes > MAX_GRANT_BYTES:
            raise InvalidArgumentError(f"min_bytes {request.min_bytes} is absurd")
        # --reserve-timeout is the longest any grant waits: a client asking for
        # more (or for inf) would hold its place in the fair queue for as long.
        limit = self.daemon.settings.reserve_timeout
        timeout = min(request.timeout_seconds, limit) if request.timeout_seconds > 0 else limit
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = min(timeout, max(remaining - 0.05, 0.0))
        grant = await m.grant(session, request.min_bytes, timeout, request.pool or SHM_POOL)
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
        m = self.daemon.manager
        session = self._bound(request.session_id, request.session_token)
        check_request_id(request.request_id)
        n, nbytes = m.abort(session, request.request_id)
        self.daemon.keys.abort(request.request_id, session.stages)
        if self.daemon.peers is not None:
            # abort frees the request on every node; peers never propagate it further.
            n += await self.daemon.peers.abort_remote(request.request_id)
        return pb.AbortResponse(leases_freed=n, bytes_freed=nbytes)

    @mapped
    async def Fetch(self, request: pb.FetchRequest, context: Ctx) -> pb.FetchResponse:
        """Cross-node read: pull a foreign DataRef into this arena (see relayd.peers).
        Clients use the session socket's FetchCall; this is the same work over gRPC."""
        d = self.daemon
        session = d.manager.authenticate(request.session_id, request.session_token)
        timeout = d.fetch_timeout(request.timeout_seconds)
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = min(timeout, max(remaining - 0.05, 0.0))
        return await d.fetch(session, request.data_ref, timeout)

    @mapped
    async def Status(self, request: pb.StatusRequest, context: Ctx) -> pb.StatusResponse:
        session = self._bound(request.session_id, request.session_token)
        resp = self.daemon.status()
        if session.id not in self.daemon.admins:
            # Who runs what (pids, uids, sessions, request ids) is the operator's to see.
            for field in ("leases", "sessions", "stages"):
                resp.ClearField(field)
        return resp

    @mapped
    async def Drain(self, request: pb.DrainRequest, context: Ctx) -> pb.DrainResponse:
        session = self._bound(request.session_id, request.session_token)
        if session.id not in self.daemon.admins:
            raise PermissionDeniedError(
                "only root, the daemon's own uid and members of --admin-gid may drain relayd"
            )
        grace = request.grace_seconds if request.grace_seconds > 0 else None
        if grace is not None and not grace <= MAX_DRAIN_GRACE:
            raise InvalidArgumentError(f"grace_seconds must be at most {MAX_DRAIN_GRACE:g}")
        self.daemon.request_stop(grace=grace)
        return pb.DrainResponse(accepted=True, grace_seconds=self.daemon.drain_grace)
