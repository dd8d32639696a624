"""The ``relayd.v1.Peer`` gRPC service: what other daemons may ask of this one.

Served on ``--peer-address`` (TCP). Every call is authenticated first (the
shared peer token, see :mod:`relayd.peers`); the work itself is the
PeerManager's (handshake, heartbeat) or the LeaseManager's (release a lease a
peer pulled, abort a request), with the same rules as for local readers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypeAlias

from relayd_client.wire.errors import InvalidArgumentError, PermissionDeniedError
from relayd_client.wire.names import REQUEST_ID_MAX
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.proto import relay_pb2_grpc as pb_grpc

from .errors import mapped

if TYPE_CHECKING:
    from ..peers import PeerManager

# grpc ships no type stubs; the servicer context is untyped.
Ctx: TypeAlias = Any


class PeerService(pb_grpc.PeerServicer):
    def __init__(self, peers: PeerManager) -> None:
        self.peers = peers

    @mapped
    async def Handshake(self, request: pb.PeerHello, context: Ctx) -> pb.PeerHello:
        self.peers.authenticate(context, "handshake")
        return self.peers.on_hello(request, str(context.peer()))

    @mapped
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Ctx) -> pb.HeartbeatResponse:
        self.peers.authenticate(context, "heartbeat")
        return self.peers.on_heartbeat(request)

    @mapped
    async def ReleaseRemote(
        self, request: pb.ReleaseRemoteRequest, context: Ctx
    ) -> pb.ReleaseRemoteResponse:
        self.peers.authenticate(context, "release")
        stages = None if request.discard else ()
        released = self.peers.leases.release_from_peer(request.lease_id, request.generation, stages)
        return pb.ReleaseRemoteResponse(released=released)

    @mapped
    async def AbortRemote(
        self, request: pb.AbortRemoteRequest, context: Ctx
    ) -> pb.AbortRemoteResponse:
        self.peers.authenticate(context, "abort")
        if not request.request_id or len(request.request_id) > REQUEST_ID_MAX:
            raise InvalidArgumentError(f"request_id must be 1-{REQUEST_ID_MAX} characters")
        freed = self.peers.leases.abort_from_peer(request.request_id)
        self.peers.hooks.aborted(request.request_id)
        self.peers.push.abort(request.request_id)
        return pb.AbortRemoteResponse(leases_freed=freed)

    @mapped
    async def KeyedPut(
        self, request: pb.PeerKeyedPutRequest, context: Ctx
    ) -> pb.PeerKeyedPutResponse:
        self.peers.authenticate(context, "keyed put")
        peer = self.peers.by_node.get(request.node_id)
        if peer is None or not peer.up:
            raise PermissionDeniedError(f"node {request.node_id[:64]!r} is not a connected peer")
        self.peers.hooks.keyed_from_peer(request.node_id, request.key, request.data_ref)
        return pb.PeerKeyedPutResponse()

    @mapped
    async def PushGrant(self, request: pb.PushGrantRequest, context: Ctx) -> pb.PushGrantResponse:
        self.peers.authenticate(context, "push grant")
        return self.peers.push.grant_to(request)

    @mapped
    async def Notify(
        self, requests: AsyncIterator[pb.PeerNotices], context: Ctx
    ) -> pb.PeerNoticesAck:
        self.peers.authenticate(context, "notify")
        released = 0
        async for batch in requests:
            released += self.peers.push.on_notices(batch)
        return pb.PeerNoticesAck(released=released)
