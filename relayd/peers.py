"""Peer daemons and what crosses nodes: the peer layer's one entry point.

Started by the daemon only when ``--peer-address`` is set. It then owns:

* the cross-node transport (Mooncake: one engine, the whole arena registered
  once at start);
* the ``relayd.v1.Peer`` gRPC server on ``--peer-address`` (TCP);
* the links to peer daemons (:mod:`relayd.peer_links`: handshakes,
  heartbeats, the shared token);
* per-peer credits (:class:`~relayd.transports.credits.CreditPool`);
* the pull (:mod:`relayd.pull`), the push (:mod:`relayd.push`) and the
  batched notices between daemons (:mod:`relayd.peer_notices`);
* keyed puts (handed over and, given up on, taken back:
  :mod:`relayd.peer_keyed`), discards and aborts that reach other nodes.

It receives the parts of the daemon it uses (:mod:`relayd.peer_context`),
not the daemon.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import grpc
from relayd_client.wire.errors import PeerUnavailableError, PermissionDeniedError
from relayd_client.wire.framing import NOTICE_LINGER_S
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.proto import relay_pb2_grpc as pb_grpc
from relayd_client.wire.status import from_rpc_error
from relayd_client.wire.version import PROTOCOL_VERSION

from .peer_channel import NO_CHANNEL, NoticeListener
from .peer_context import PeerHooks, PeerLeases, PeerParts
from .peer_keyed import KeyedHandOver
from .peer_links import PeerLinks, PeerState, server_options, split_address
from .peer_notices import PeerNotifier
from .pools.reclaim import Aborter
from .pools.sessions import Session
from .pull import Puller
from .push import PushManager
from .transports.base import MemoryRegion, RemoteTransport
from .transports.credits import CreditPool

if TYPE_CHECKING:
    from .config import Settings
    from .pools.arena import Arena

log = logging.getLogger(__name__)

_ABORT_ORIGINS = 4096


def segment_address(mm: Any) -> int:
    """Base address of a mapping; the ctypes view is dropped at once so the
    mapping can still be closed at shutdown."""
    view = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(view)
    finally:
        del view


class PeerManager:
    def __init__(
        self,
        settings: Settings,
        *,
        epoch: str,
        arena: Arena,
        leases: PeerLeases,
        hooks: PeerHooks | None = None,
        transport: RemoteTransport | None = None,
    ) -> None:
        self.settings = settings
        self.epoch = epoch
        self.leases = leases
        self.hooks = hooks or PeerHooks()
        if transport is None:
            from .transports.mooncake import MooncakeTransport

            transport = MooncakeTransport(settings)
        self.transport = transport
        self.credits = CreditPool(settings.peer_credits)
        self.links = PeerLinks(
            settings,
            epoch,
            hello=self.hello,
            local_stages=self.hooks.local_stages,
            peer_stages=self.hooks.peer_stages,
            events=self,
        )
        self.notifier = PeerNotifier(self.links, NOTICE_LINGER_S)
        self.keyed = KeyedHandOver(self.links, settings.node_id, settings.peer_timeout)
        self.parts = PeerParts(
            settings, epoch, arena, leases, self.hooks, transport, self.credits, self.links,
            self.notifier,
        )  # fmt: skip
        self.push = PushManager(self.parts)
        self.puller = Puller(self.parts, self.push.landing, self._note_origin)
        self._server: grpc.aio.Server | None = None
        self._notices_in: NoticeListener | None = None
        self.notice_port = 0  # of our notice channel, once it listens; 0: none
        # request id -> peers its pulled leases came from, so abort reaches them.
        self._origins: collections.OrderedDict[str, set[str]] = collections.OrderedDict()

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        from .rpc.peer_service import PeerService

        await self.transport.start()
        for seg in self.parts.arena.segments:
            base = segment_address(seg.mm)
            await self.transport.register(MemoryRegion(seg.name, base, seg.size))
            self.parts.local_bases.append(base)
        server = grpc.aio.server(options=server_options(self.settings.peer_timeout))
        pb_grpc.add_PeerServicer_to_server(
            PeerService(links=self.links, leases=self.leases, hooks=self.hooks, push=self.push),
            server,
        )
        port = server.add_insecure_port(self.settings.peer_address)
        await server.start()
        self._server = server
        await self._listen_for_notices()
        # Even with pushes off here: a put that asked for one is declined, so the
        # reader's daemon pulls at once instead of waiting for it.
        self.leases.on_push = self.push.on_publish
        log.info(
            "peer service on %s (port %d), mooncake session %s, %d peer entries",
            self.settings.peer_address,
            port,
            self.transport.session_id,
            len(self.settings.peers),
        )
        self.links.start()

    async def _listen_for_notices(self) -> None:
        if self.settings.peer_notice_port == NO_CHANNEL:
            return
        links = self.links

        def accept(node_id: str, epoch: str) -> bool:
            peer = links.by_node.get(node_id)
            return peer is not None and peer.up and peer.epoch == epoch

        push = self.push
        listener = NoticeListener(links.token, accept, push.on_notices, push.place, push.unplace)
        host, _ = split_address(self.settings.peer_address)
        try:
            self.notice_port = await listener.start(host, self.settings.peer_notice_port)
        except OSError as exc:
            # Notices still flow, on the Peer service: slower, not broken.
            log.warning(
                "no notice channel (port %d on %s): %s; peers send notices on the Peer service",
                self.settings.peer_notice_port,
                host,
                exc,
            )
            return
        self._notices_in = listener
        log.info("notice channel on %s port %d", host, self.notice_port)

    async def close(self) -> None:
        await self.keyed.close()
        await self.links.close()
        if self._notices_in is not None:
            await self._notices_in.close()
        await self.push.close()
        await self.notifier.close()
        if self._server is not None:
            await self._server.stop(grace=0.5)
        await self.transport.close()

    # -- who we are -------------------------------------------------------------------

    def hello(self) -> pb.PeerHello:
        arena = self.parts.arena
        return pb.PeerHello(
            protocol_version=PROTOCOL_VERSION,
            node_id=self.settings.node_id,
            daemon_epoch=self.epoch,
            peer_address=self.settings.peer_address,
            mooncake_session=self.transport.session_id,
            slot_size=arena.slot_size,
            segments=[
                pb.ArenaSegment(
                    index=seg.index,
                    base=base,
                    size=seg.size,
                    data_offset=seg.data_offset,
                    nslots=seg.nslots,
                )
                for seg, base in zip(arena.segments, self.parts.local_bases, strict=True)
            ],
            stages=self.hooks.local_stages(),
            notice_port=self.notice_port,
        )

    # -- what the links tell (LinkEvents) --------------------------------------------

    async def beat(self, peer: PeerState) -> None:
        self.notifier.ensure_channel(peer)
        self.push.ask_unreceived(peer)
        if self.push.enabled and peer.address not in self.push.out:
            # Right after the handshake, then on each beat until the peer has room
            # (it may not have dialled us back yet).
            await self.push.ask_grant(peer)

    def lost(self, peer: PeerState) -> None:
        self.push.peer_down(peer)
        self.notifier.forget(peer.address)
        if self._notices_in is not None and peer.up:
            # Its connection to us may wait for ever on bytes that a vanished peer
            # will not send, holding the run placed for them; after peer_down, which
            # voided its grant, that run goes straight back to the arena. A peer
            # not up here has no connection accepted (its node id may be up again
            # at another address).
            self._notices_in.drop_node(peer.node_id, peer.epoch)

    def greeted_again(self, peer: PeerState) -> None:
        self.push.grant_void(peer)

    # -- reads, keyed delivery and discard (see relayd.rpc.keyed) ----------------------

    async def fetch(self, session: Session, data: bytes, timeout: float) -> pb.LeaseRef:
        """Pull a foreign DataRef into this arena (or take its landed push); the local lease."""
        return await self.puller.fetch(session, data, timeout)

    def start_fetch(
        self, session: Session, data: bytes, timeout: float
    ) -> pb.LeaseRef | Coroutine[Any, Any, pb.LeaseRef]:
        """:meth:`fetch`, answered now when the push has landed (see ``Puller.start``)."""
        return self.puller.start(session, data, timeout)

    @property
    def timeout(self) -> float:
        """What bounds one call to a peer (``--peer-timeout``)."""
        return self.settings.peer_timeout

    def serving(self, stage: str) -> PeerState | None:
        """A live peer that serves ``stage`` (the first by address when several do)."""
        return self.links.serving(stage)

    async def keyed_put(
        self, peer: PeerState, key: str, data_ref: bytes, timeout: float | None = None
    ) -> None:
        """Hand a keyed DataRef to the peer that serves its consumer, within ``timeout``
        (None: the peer timeout); its errors are ours. Given up on without the peer's
        answer, it is taken back there (see :mod:`relayd.peer_keyed`)."""
        await self.keyed.put(peer, key, data_ref, timeout)

    async def keyed_withdraw(self, peer: PeerState, key: str, data_ref: bytes) -> bool:
        """Have ``peer`` drop its unread entry of the keyed put of ``data_ref`` under
        ``key`` if it names that very lease: whether it did."""
        return await self.keyed.withdraw(peer, key, data_ref)

    async def release_now(self, m: pb.DataRef, stages: tuple[str, ...]) -> bool:
        """Free a lease of another node now (a discard by a session serving ``stages``);
        False when it was gone already. A lease pushed here is freed here: the writer's
        node freed its own on landing. The lease's record judges whether ``stages`` may
        (PermissionDeniedError): the landed one here, the writer's daemon's there."""
        if self.push.landing.discard(m, stages):
            return True
        peer = self.links.peer_for(m)
        release = pb.ReleaseRemoteRequest(
            lease_id=m.lease.lease_id,
            generation=m.lease.generation,
            node_id=self.settings.node_id,
            discard=True,
            stages=stages,
        )
        try:
            resp = await self.links.call(peer, "ReleaseRemote", release)
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
            if isinstance(err, PermissionDeniedError):
                # The writer's daemon refused the discarding session: its answer, not a
                # peer that failed.
                raise PermissionDeniedError(f"peer {peer.address}: {err.message or err}") from None
            raise PeerUnavailableError(
                f"peer {peer.address} did not free the lease: {err.message or err}"
            ) from None
        return bool(resp.released)

    # -- abort ------------------------------------------------------------------------

    def _note_origin(self, request_id: str, address: str) -> None:
        origins = self._origins.setdefault(request_id, set())
        origins.add(address)
        self._origins.move_to_end(request_id)
        while len(self._origins) > _ABORT_ORIGINS:
            self._origins.popitem(last=False)

    async def abort_remote(
        self,
        request_id: str,
        stages: tuple[str, ...] = (),
        narrow: bool = False,
        by: Aborter | None = None,
    ) -> int:
        """Tell every live peer (the origins of this request's pulls first of all);
        ``stages``: the aborting session's, for the peers to check, and with ``narrow``
        the stages the abort is narrowed to; ``by``: who aborts, for the peers to
        narrow it by their own writers' uids (see AbortRemoteRequest)."""
        if not narrow:  # a narrowed one leaves the waits to their pushes' fate
            self.push.landing.abort(request_id)
        targets = {p.address for p in self.links.peers.values() if p.up}
        targets |= self._origins.pop(request_id, set())
        peers = self.links.peers
        calls = [
            self._abort_one(peers[a], request_id, stages, narrow, by) for a in targets if a in peers
        ]
        results = await asyncio.gather(*calls)
        return sum(results)

    async def _abort_one(
        self,
        peer: PeerState,
        request_id: str,
        stages: tuple[str, ...],
        narrow: bool,
        by: Aborter | None,
    ) -> int:
        if peer.stub is None:
            return 0
        abort = pb.AbortRemoteRequest(
            request_id=request_id, node_id=self.settings.node_id, stages=stages, narrow=narrow
        )
        if by is not None:
            abort.aborter_uid = by.uid
            abort.aborter_stages.extend(by.stages)
        try:
            resp = await self.links.call(peer, "AbortRemote", abort)
        except grpc.RpcError as exc:
            log.warning(
                "abort of %s not delivered to peer %s: %s",
                request_id,
                peer.address,
                from_rpc_error(exc).message,
            )
            return 0
        return int(resp.leases_freed)

    # -- views ------------------------------------------------------------------------

    def snapshot(self) -> dict[str, dict[str, Any]]:
        credits = self.credits.stats()
        in_use: dict[str, float] = {}
        capacity: dict[str, float] = {}
        up: dict[str, float] = {}
        channel: dict[str, float] = {}
        queued: dict[str, float] = {}
        for address, peer in self.links.others():
            c = credits.get(address)
            in_use[address] = c.in_use if c else 0
            capacity[address] = self.credits.capacity(address)
            up[address] = 1 if peer.up else 0
            channel[address] = 1 if self.notifier.has_channel(address) else 0
            queued[address] = self.notifier.queued(address)
        return {
            "credits_in_use": in_use,
            "credits_capacity": capacity,
            "peer_up": up,
            "notice_channel": channel,
            "notice_channel_queued": queued,
            "pushes": {address: self.push.status(address) for address, _ in self.links.others()},
        }

    def status(self) -> list[pb.PeerStatus]:
        out = []
        for address, peer in self.links.others():
            out.append(
                pb.PeerStatus(
                    address=address,
                    node_id=peer.node_id,
                    up=peer.up,
                    daemon_epoch=peer.epoch,
                    mooncake_session=peer.mooncake_session,
                    credits_in_use=self.credits.in_use(address),
                    credits_capacity=self.credits.capacity(address),
                    pulls_in_flight_max=peer.in_flight_max,
                    last_error=peer.last_error[:512],
                    stages=list(peer.stages),
                    notice_channel=self.notifier.has_channel(address),
                    notice_batches=self.notifier.channel_batches(address),
                    **self.push.status(address),
                )
            )
        return out


__all__ = ["PeerManager", "segment_address"]
