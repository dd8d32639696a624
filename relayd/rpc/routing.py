"""``Route`` and the socket fallback (``PutBytes``/``GetBytes``) of the Relay service.

A mixin of :class:`relayd.rpc.service.RelayService`, which gives it the parts
declared below, so that routing and the fallback read as one concern.

The socket fallback serves sessions that cannot map the arena (a container
without the host's IPC namespace) with one unary call per put or get carrying
the packed region. A put+get costs about what SHM costs at 64 KiB and 3-7x as
much at 4 MiB (two extra copies plus gRPC framing): acceptable for a path
that announces itself in status and metrics, and it needs no second framing
protocol. The bytes still land in an arena lease
(:meth:`~relayd.pools.leases.LeaseManager.put_bytes`), so an SHM reader reads
a socket writer's put exactly like any other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

from relayd_client.wire.errors import InvalidArgumentError, SessionClosedError
from relayd_client.wire.names import REQUEST_ID_MAX, STAGE_NAME_MAX
from relayd_client.wire.proto import relay_pb2 as pb

from ..edges import log_trace
from ..pools.arena import Arena
from ..pools.leases import LeaseManager
from ..pools.sessions import Session, SessionState
from ..routing.topology import Topology
from .deadlines import give_back_if_too_late, within_deadline
from .errors import mapped

Ctx: TypeAlias = Any


class RoutingService:
    leases: LeaseManager
    arena: Arena
    topology: Topology
    reserve_timeout: float
    """The longest a grant (here: a socket-fallback put) may wait for space."""
    on_ref: Callable[[int], None]
    """A forwarded tensor reference of this many bytes was published."""

    def _bound(self, session_id: str, token: bytes) -> Session:
        session = self.leases.authenticate(session_id, token)
        if session.state is not SessionState.BOUND:
            raise SessionClosedError("bind the session socket first")
        return session

    @mapped
    async def Route(self, request: pb.RouteRequest, context: Ctx) -> pb.RouteResponse:
        session = self._bound(request.session_id, request.session_token)
        if not request.to_stage or len(request.to_stage) > STAGE_NAME_MAX:
            raise InvalidArgumentError(f"to_stage must be 1-{STAGE_NAME_MAX} characters")
        return self.topology.route(session, request)

    @mapped
    async def PutBytes(self, request: pb.PutBytesRequest, context: Ctx) -> pb.PutBytesResponse:
        session = self._bound(request.session_id, request.session_token)
        if not request.request_id or len(request.request_id) > REQUEST_ID_MAX:
            raise InvalidArgumentError(f"request_id must be 1-{REQUEST_ID_MAX} characters")
        if not request.to_stage or len(request.to_stage) > STAGE_NAME_MAX:
            raise InvalidArgumentError(f"to_stage must be 1-{STAGE_NAME_MAX} characters")
        from_stage = (
            request.from_stage if request.from_stage in session.stages else session.stages[0]
        )
        timeout = request.timeout_seconds if request.timeout_seconds > 0 else self.reserve_timeout
        timeout = within_deadline(timeout, context)
        data = request.data
        lease = await self.leases.put_bytes(
            session,
            data,
            request_id=request.request_id,
            to_stage=request.to_stage,
            from_stage=from_stage,
            timeout=timeout,
        )
        # Published, but maybe resumed too late (a busy loop, as for Grant): a writer
        # that never learns the DataRef hands it to nobody. Discarded then, as a holder
        # of its DataRef would (KeyedCalls.discard).
        give_back_if_too_late(
            context, "put", f"put lease {lease.id} discarded", session.id,
            lambda: self.leases.release_from_peer(lease.id, lease.generation),
        )  # fmt: skip
        if request.trace_id:
            log_trace(lease.id, request.trace_id, request.request_id)
        if request.ref:
            self.on_ref(len(data))
        run = lease.run
        return pb.PutBytesResponse(
            lease=pb.LeaseRef(
                pool=run.pool,
                segment=run.segment,
                slot=run.slot,
                nslots=run.nslots,
                offset=self.arena.segments[run.segment].slot_offset(run.slot),
                length=len(data),
                generation=lease.generation,
                lease_id=lease.id,
            )
        )

    @mapped
    async def GetBytes(self, request: pb.GetBytesRequest, context: Ctx) -> pb.GetBytesResponse:
        session = self._bound(request.session_id, request.session_token)
        ref = request.lease
        data = await self.leases.read_out(session, ref.lease_id, ref.generation, request.request_id)
        # Counted once, when it was published, under its DataRef's transport.
        return pb.GetBytesResponse(data=data)
