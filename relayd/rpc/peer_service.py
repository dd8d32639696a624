"""The ``relayd.v1.Peer`` gRPC service: what other daemons may ask of this one.

Served on ``--peer-address`` (TCP). Every call is authenticated first (the
shared peer token, see :mod:`relayd.peer_links`); the work itself is the peer
links' (handshake, heartbeat), the push's (grants, notices), the lease
table's (release a lease a peer pulled, discard one for a session there,
abort a request) or the key index's (a keyed put, and taking one back), with
the same rules as for local sessions.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeAlias, TypeVar

from relayd_client.wire.dataref import DataRef
from relayd_client.wire.errors import (
    InvalidArgumentError,
    PermissionDeniedError,
    RelayError,
    RelayTimeoutError,
)
from relayd_client.wire.names import MAX_SESSION_STAGES, REQUEST_ID_MAX, check_stage
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.proto import relay_pb2_grpc as pb_grpc

from ..peer_context import PeerHooks, PeerLeases
from ..peer_links import PeerLinks
from ..peer_notices import notice_count
from ..pools.reclaim import Aborter
from ..push import PushManager
from .deadlines import too_late
from .errors import mapped

log = logging.getLogger(__name__)

# grpc ships no type stubs; the servicer context is untyped.
Ctx: TypeAlias = Any
R = TypeVar("R")


def _peer_call(
    what: str,
) -> Callable[[Callable[..., Awaitable[R]]], Callable[..., Awaitable[R]]]:
    """A Peer method: the caller must hold our token; errors become statuses."""

    def wrap(fn: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
        @functools.wraps(fn)
        async def call(self: PeerService, request: Any, context: Ctx) -> R:
            self.links.authenticate(context, what)
            return await fn(self, request, context)

        return mapped(call)

    return wrap


def _stages(names: Sequence[str], what: str) -> tuple[str, ...]:
    """The stages of a session on the peer's node, as a call names them, checked."""
    if len(names) > MAX_SESSION_STAGES:
        raise InvalidArgumentError(f"{what} names at most {MAX_SESSION_STAGES} stages")
    return tuple(check_stage(s) for s in names)


class PeerService(pb_grpc.PeerServicer):
    def __init__(
        self, *, links: PeerLinks, leases: PeerLeases, hooks: PeerHooks, push: PushManager
    ) -> None:
        self.links = links
        self.leases = leases
        self.hooks = hooks
        self.push = push

    @_peer_call("handshake")
    async def Handshake(self, request: pb.PeerHello, context: Ctx) -> pb.PeerHello:
        return self.links.on_hello(request, str(context.peer()))

    @_peer_call("heartbeat")
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Ctx) -> pb.HeartbeatResponse:
        return self.links.on_heartbeat(request)

    @_peer_call("release")
    async def ReleaseRemote(
        self, request: pb.ReleaseRemoteRequest, context: Ctx
    ) -> pb.ReleaseRemoteResponse:
        crossnode = self.leases.crossnode
        if not request.discard:
            released = crossnode.release_from_peer(request.lease_id, request.generation, ())
            return pb.ReleaseRemoteResponse(released=released)
        # The writer's daemon judges a discard by its own record of the lease. A peer
        # that names no stages predates the check and vouches for none: only a lease
        # anyone may read (adopted) goes, as a session serving no stage could free.
        stages = _stages(request.stages, "a discard")
        try:
            released = await crossnode.discard(request.lease_id, request.generation, stages)
        except PermissionDeniedError as err:
            log.warning(
                "discard of lease %d from peer %s (node %r) refused: %s%s",
                request.lease_id,
                context.peer(),
                request.node_id[:64],
                err,
                "" if stages else " (the peer named no stages: it predates the check)",
            )
            raise
        return pb.ReleaseRemoteResponse(released=released)

    @_peer_call("abort")
    async def AbortRemote(
        self, request: pb.AbortRemoteRequest, context: Ctx
    ) -> pb.AbortRemoteResponse:
        if not request.request_id or len(request.request_id) > REQUEST_ID_MAX:
            raise InvalidArgumentError(f"request_id must be 1-{REQUEST_ID_MAX} characters")
        stages = _stages(request.stages, "an abort")
        by = None
        if request.HasField("aborter_uid"):
            by = Aborter(request.aborter_uid, _stages(request.aborter_stages, "an abort"))
        freed, narrowed = self.leases.abort_from_peer(
            request.request_id, stages, request.narrow, by
        )
        self.hooks.aborted(request.request_id, narrowed)
        if narrowed is None:  # a narrowed one leaves the waits to their pushes' fate
            self.push.landing.abort(request.request_id)
        return pb.AbortRemoteResponse(leases_freed=freed)

    def _connected(self, node_id: str) -> None:
        """A keyed call names the node it comes from: one of our connected peers."""
        peer = self.links.by_node.get(node_id)
        if peer is None or not peer.up:
            raise PermissionDeniedError(f"node {node_id[:64]!r} is not a connected peer")

    @_peer_call("keyed put")
    async def KeyedPut(
        self, request: pb.PeerKeyedPutRequest, context: Ctx
    ) -> pb.PeerKeyedPutResponse:
        self._connected(request.node_id)
        if too_late(context):
            # Reached too late (a busy loop) for the answer to arrive: the writer's daemon
            # has had its deadline, told the writer the put failed and freed the put's
            # lease. Indexed now, the key would hand a reader that freed lease and
            # refuse the writer's retry of the key. Nothing is indexed, as for any
            # failed put. (An answer sent in time but received late fails the put the
            # same way while the key stays here: gRPC does not tell this handler.)
            log.info(
                "keyed put of %r from node %r refused: its answer would come too late",
                request.key[:64],
                request.node_id[:64],
            )
            raise RelayTimeoutError("the keyed put came too late for the call's deadline")
        self.hooks.keyed_from_peer(request.node_id, request.key, request.data_ref)
        return pb.PeerKeyedPutResponse()

    @_peer_call("keyed withdraw")
    async def KeyedWithdraw(
        self, request: pb.PeerKeyedWithdrawRequest, context: Ctx
    ) -> pb.PeerKeyedWithdrawResponse:
        # Only an entry naming that very lease of the sender's own node goes
        # (``KeyedCalls.withdraw_from_peer``): a peer cannot take back another
        # node's put, nor a later put of the same key.
        self._connected(request.node_id)
        withdrawn = self.hooks.keyed_withdraw(request.node_id, request.key, request.data_ref)
        if withdrawn:
            # Its bytes, if pushed here, wait for a reader that can no longer find
            # them: freed now, not at the TTL. (Checked above: the sender's own put.)
            m = DataRef.from_bytes(request.data_ref).proto
            self.push.landing.discard(m, (m.origin.stage,))
        return pb.PeerKeyedWithdrawResponse(withdrawn=withdrawn)

    @_peer_call("push grant")
    async def PushGrant(self, request: pb.PushGrantRequest, context: Ctx) -> pb.PushGrantResponse:
        return self.push.landing.grant_to(request)

    @_peer_call("notify")
    async def Notify(
        self, requests: AsyncIterator[pb.PeerNotices], context: Ctx
    ) -> pb.PeerNoticesAck:
        released = handled = 0
        async for batch in requests:
            try:
                released += self.push.on_notices(batch)
            except RelayError as err:
                # The stream ends with err's status: this batch, and whatever the
                # peer wrote after it, go unhandled (the peer logs them lost too).
                log.warning(
                    "Notify stream from %s (node %r) ended after %d batch(es): "
                    "a batch of %d notice(s) refused: %s",
                    context.peer(),
                    batch.node_id[:64],
                    handled,
                    notice_count(batch),
                    err,
                )
                raise
            handled += 1
        return pb.PeerNoticesAck(released=released)
