"""``Route`` and the socket fallback (``PutBytes``/``GetBytes``) of the Relay service.

Kept beside :mod:`relayd.rpc.service` as a mixin so routing stays one concern.

The socket fallback serves sessions that cannot map the arena (a container
without the host's IPC namespace) with one unary call per put or get carrying
the packed region. Measured put+get on a busy 2-core machine: about the same
as SHM at 64 KiB, about 3-7x slower at 4 MiB (two extra copies plus gRPC
framing). That is acceptable for a path that announces itself in status and
metrics, and it needs no second framing protocol. The bytes
still land in an arena lease, so an SHM reader reads a socket writer's put
exactly like any other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias

from relayd_client.wire.errors import (
    AbortedError,
    InvalidArgumentError,
    PermissionDeniedError,
    SessionClosedError,
    StaleRefError,
)
from relayd_client.wire.names import REQUEST_ID_MAX, STAGE_NAME_MAX
from relayd_client.wire.proto import relay_pb2 as pb

from ..edges import log_trace
from ..pools.leases import LeaseState, Session, SessionState
from .errors import mapped

if TYPE_CHECKING:
    from ..server import Daemon

Ctx: TypeAlias = Any


class RoutingService:
    daemon: Daemon

    def _bound(self, session_id: str, token: bytes) -> Session:
        session = self.daemon.manager.authenticate(session_id, token)
        if session.state is not SessionState.BOUND:
            raise SessionClosedError("bind the session socket first")
        return session

    @mapped
    async def Route(self, request: pb.RouteRequest, context: Ctx) -> pb.RouteResponse:
        session = self._bound(request.session_id, request.session_token)
        if not request.to_stage or len(request.to_stage) > STAGE_NAME_MAX:
            raise InvalidArgumentError(f"to_stage must be 1-{STAGE_NAME_MAX} characters")
        return self.daemon.topology.route(session, request)

    @mapped
    async def PutBytes(self, request: pb.PutBytesRequest, context: Ctx) -> pb.PutBytesResponse:
        d = self.daemon
        m = d.manager
        session = self._bound(request.session_id, request.session_token)
        if not request.request_id or len(request.request_id) > REQUEST_ID_MAX:
            raise InvalidArgumentError(f"request_id must be 1-{REQUEST_ID_MAX} characters")
        if not request.to_stage or len(request.to_stage) > STAGE_NAME_MAX:
            raise InvalidArgumentError(f"to_stage must be 1-{STAGE_NAME_MAX} characters")
        req = m.requests.get(request.request_id)
        if req is not None and req.aborted:
            raise AbortedError(f"request {request.request_id!r} was aborted")
        from_stage = (
            request.from_stage if request.from_stage in session.stages else session.stages[0]
        )
        data = request.data
        timeout = (
            request.timeout_seconds if request.timeout_seconds > 0 else d.settings.reserve_timeout
        )
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = min(timeout, max(remaining - 0.05, 0.0))
        grant = await m.grant(session, max(len(data), 1), timeout)
        run = grant.run
        seg = d.arena.segments[run.segment]
        nslots = max(1, -(-len(data) // d.arena.slot_size))
        lease_id = m.new_generation_base(grant) + 1
        start = seg.slot_offset(run.slot)
        seg.mm[start : start + len(data)] = data
        seg.write_header(run.slot, lease_id, len(data))
        m.on_reserve(
            session,
            pb.Reserve(
                lease_id=lease_id,
                grant_id=grant.id,
                slot=run.slot,
                nslots=nslots,
                generation=lease_id,
                request_id=request.request_id,
                to_stage=request.to_stage,
                from_stage=from_stage,
            ),
        )
        if request.trace_id:
            log_trace(lease_id, request.trace_id, request.request_id)
        m.on_publish(
            session, pb.Publish(lease_id=lease_id, nbytes=len(data), transport=pb.TRANSPORT_SOCKET)
        )
        # The lease now belongs to the daemon, like a dead writer's published
        # one: it frees its own run when read, aborted or expired.
        m.detach_grant(session, grant)
        m.flush()
        if request.ref:
            d.count_ref(len(data))
        return pb.PutBytesResponse(
            lease=pb.LeaseRef(
                pool="shm",
                segment=run.segment,
                slot=run.slot,
                nslots=nslots,
                offset=start,
                length=len(data),
                generation=lease_id,
                lease_id=lease_id,
            )
        )

    @mapped
    async def GetBytes(self, request: pb.GetBytesRequest, context: Ctx) -> pb.GetBytesResponse:
        d = self.daemon
        m = d.manager
        session = self._bound(request.session_id, request.session_token)
        ref = request.lease
        lease = m.leases.get(ref.lease_id)
        if (
            lease is None
            or lease.generation != ref.generation
            or lease.state is not LeaseState.PUBLISHED
        ):
            req = m.requests.get(request.request_id)
            if req is not None and req.aborted:
                raise AbortedError(f"request {request.request_id!r} was aborted")
            raise StaleRefError(
                "DataRef's lease was already read, reclaimed (TTL) or aborted; it cannot be read again"
            )
        if lease.to_stage not in session.stages:
            raise PermissionDeniedError(f"lease is addressed to stage {lease.to_stage!r}")
        m.on_claim(session, pb.Claim(lease_id=lease.id, generation=lease.generation))
        seg = d.arena.segments[lease.run.segment]
        start = seg.slot_offset(lease.run.slot)
        data = bytes(seg.mm[start : start + lease.nbytes])
        m.on_release(session, pb.Release(lease_id=lease.id, generation=lease.generation))
        m.flush()
        # Counted once, when it was published, under its DataRef's transport.
        return pb.GetBytesResponse(data=data)
