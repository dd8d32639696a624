"""Peer daemons: who they are and whether they answer.

One dial loop per peer address: handshake (protocol version, shared token,
node identity, Mooncake session, arena geometry, stages), then heartbeats
every ``peer_timeout / 4`` (at most 1 s). A failed heartbeat marks the peer
down at once; the loop keeps re-dialling (backing off to 1 s, 5 s after a
refused token), so a restarted peer is picked up with its new epoch and
Mooncake session without restarting anything here.

Peers are named by their Peer-service address ``host:port`` (metrics label
``peer``). ``--peers`` entries may be DNS names resolving to several addresses
(a Kubernetes headless service); they are re-resolved every
``RESOLVE_INTERVAL`` seconds, and our own address and node id are skipped.
A daemon that dials us is dialled back, so one side listing the other is
enough. Both ends of a Peer connection ping it once it is silent, and drop it
when a ping goes unanswered (:data:`KEEPALIVE_MIN_S`).

Authentication: every Peer call carries the token from ``--peer-token-file``
in the ``relayd-peer-token-bin`` metadata, compared in constant time. The link
itself is plaintext gRPC: the token keeps out daemons (and tools) that were not
given it, not an attacker who can sniff the cluster network (see the README).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import socket
import stat
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from relayd_client.wire.errors import (
    PeerUnavailableError,
    PermissionDeniedError,
    RelayError,
    StaleEpochError,
    VersionMismatchError,
)
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.proto import relay_pb2_grpc as pb_grpc
from relayd_client.wire.status import from_rpc_error
from relayd_client.wire.version import PROTOCOL_VERSION

if TYPE_CHECKING:
    from .config import Settings

log = logging.getLogger(__name__)

TOKEN_KEY = "relayd-peer-token-bin"
RESOLVE_INTERVAL = 10.0
_REFUSED_BACKOFF = 5.0
_MAX_BACKOFF = 1.0
# Either end of a Peer connection that has read nothing on it for keepalive_ms pings
# the other, and drops the connection when the ping is not answered within
# keepalive_ms more. Else a peer that vanished (its host gone: no FIN, no RST), or
# a middlebox that forgot the connection, would hold it, and the server's end of
# its Notify stream, for over two hours (gRPC's default): that end sends nothing,
# so TCP has nothing to retransmit and never gives up. keepalive_ms is the peer
# timeout, at least KEEPALIVE_MIN_S; a live peer's heartbeats (several a peer
# timeout) leave the pings unsent.
KEEPALIVE_MIN_S = 1.0


class PeerConfigError(RelayError):
    """The peer settings cannot work; the message says what to fix."""


def load_token(path: str) -> bytes:
    if not path:
        raise PeerConfigError(
            "--peer-address needs --peer-token-file: peers authenticate with a shared "
            "secret (e.g. `head -c 32 /dev/urandom | base64 > token`, same file on every node)"
        )
    try:
        with open(path, "rb") as fh:
            mode = os.fstat(fh.fileno()).st_mode
            token = fh.read().strip()
    except OSError as exc:
        raise PeerConfigError(f"cannot read --peer-token-file {path}: {exc.strerror}") from exc
    if mode & 0o007:
        # Whoever can read the token can join as a peer: pull, release, abort.
        raise PeerConfigError(
            f"--peer-token-file {path} is open to every user on this host (mode "
            f"{stat.S_IMODE(mode):04o}); make it private: chmod 600 {path} (or 640 with "
            "relayd's group)"
        )
    if len(token) < 16:
        raise PeerConfigError(f"the peer token in {path} is shorter than 16 bytes; make it longer")
    return token


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _resolve(entry: str) -> list[str]:
    """``host:port`` -> every address it names (a headless service names several)."""
    host, port = split_address(entry)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({_join(str(info[4][0]), port) for info in infos})


def keepalive_ms(peer_timeout: float) -> int:
    """How long a Peer connection may be silent before a ping, and its answer take."""
    return round(max(peer_timeout, KEEPALIVE_MIN_S) * 1000)


def keepalive_options(time_ms: int, timeout_ms: int) -> list[tuple[str, int]]:
    """gRPC options for a connection that pings its other end after ``time_ms``
    of silence and drops it when the answer takes over ``timeout_ms``."""
    return [
        ("grpc.keepalive_time_ms", time_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # How long gRPC waits for any ping's answer: keepalive_timeout_ms alone
        # leaves a keepalive ping's at a minute (grpcio 1.85).
        ("grpc.http2.ping_timeout_ms", timeout_ms),
    ]


def _keepalive(peer_timeout: float) -> list[tuple[str, int]]:
    ms = keepalive_ms(peer_timeout)
    return [
        *keepalive_options(ms, ms),
        # The connection may be dead between calls too (a heartbeat is one)...
        ("grpc.keepalive_permit_without_calls", 1),
        # ... and while its calls send nothing (an idle Notify stream).
        ("grpc.http2.max_pings_without_data", 0),
    ]


def channel_options(peer_timeout: float) -> list[tuple[str, int]]:
    """A channel to a peer's Peer service: no retries (a call that failed tells of
    the peer), keepalive pings (see :data:`KEEPALIVE_MIN_S`)."""
    return [("grpc.enable_retries", 0), *_keepalive(peer_timeout)]


def server_options(peer_timeout: float) -> list[tuple[str, int]]:
    """The Peer service's server: it pings its peers as their channels ping it, and
    takes their pings. By default a server counts a ping less than 5 minutes after
    the last one (while it sent no data) as abuse, and ends the connection at the
    third (GOAWAY too_many_pings); a peer's channel pings every keepalive_ms, and
    its timer may fire a little early."""
    return [
        ("grpc.so_reuseport", 0),
        *_keepalive(peer_timeout),
        ("grpc.http2.min_ping_interval_without_data_ms", keepalive_ms(peer_timeout) // 2),
    ]


@dataclasses.dataclass(eq=False)
class PeerState:
    """One peer daemon as this daemon sees it."""

    address: str
    channel: grpc.aio.Channel | None = None
    stub: pb_grpc.PeerStub | None = None
    up: bool = False
    node_id: str = ""
    epoch: str = ""
    mooncake_session: str = ""
    notice_port: int = 0  # its notice channel (relayd.peer_channel); 0: none
    slot_size: int = 0
    segments: dict[int, pb.ArenaSegment] = dataclasses.field(default_factory=dict)
    stages: tuple[str, ...] = ()
    last_error: str = ""
    in_flight: int = 0
    in_flight_max: int = 0
    task: asyncio.Task[None] | None = None
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def forget_identity(self) -> None:
        self.up = False
        self.notice_port = 0
        self.segments = {}
        self.stages = ()


class LinkEvents(Protocol):
    """What the rest of the peer layer hears from the links."""

    async def beat(self, peer: PeerState) -> None:
        """After each handshake and heartbeat that found ``peer`` up (off every path)."""

    def lost(self, peer: PeerState) -> None:
        """``peer`` went down; its identity is still there, forgotten right after."""

    def greeted_again(self, peer: PeerState) -> None:
        """``peer``, up here, handshook again: it had taken us for lost."""


class PeerLinks:
    """The peers of this daemon by address and by node id, and their dial loops."""

    def __init__(
        self,
        settings: Settings,
        epoch: str,
        *,
        hello: Callable[[], pb.PeerHello],
        local_stages: Callable[[], list[str]],
        peer_stages: Callable[[str, Iterable[str] | None], None],
        events: LinkEvents,
    ) -> None:
        self.settings = settings
        self.epoch = epoch
        self.token = load_token(settings.peer_token_file)
        self.hello = hello
        self.local_stages = local_stages
        self.peer_stages = peer_stages
        self.events = events
        self.peers: dict[str, PeerState] = {}
        self.by_node: dict[str, PeerState] = {}
        self.heartbeat_interval = min(1.0, max(settings.peer_timeout / 4, 0.05))
        self.self_addresses: set[str] = {settings.peer_address}
        self._resolver: asyncio.Task[None] | None = None
        # Addresses the --peers names resolved to, until one goes from them and is down.
        self._named: set[str] = set()
        self._closed = False

    def start(self) -> None:
        if self.settings.peers:
            self._resolver = asyncio.get_running_loop().create_task(
                self._resolve_loop(), name="relayd-peer-resolver"
            )

    async def close(self) -> None:
        self._closed = True
        tasks = [p.task for p in self.peers.values() if p.task is not None]
        if self._resolver is not None:
            tasks.append(self._resolver)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for peer in self.peers.values():
            if peer.channel is not None:
                await peer.channel.close()

    async def call(
        self, peer: PeerState, rpc: str, request: Any, timeout: float | None = None
    ) -> Any:
        """One unary Peer call ``rpc`` to ``peer``, with our token, bounded by the peer
        timeout (and ``timeout``, its own caller's, when shorter); its failure is the
        grpc.RpcError."""
        if peer.stub is None:
            raise PeerUnavailableError(f"peer {peer.address} is not connected")
        method = getattr(peer.stub, rpc)
        limit = self.settings.peer_timeout
        if timeout is not None:
            limit = min(limit, timeout)
        return await method(request, timeout=limit, metadata=self.metadata())

    def stub_for(self, address: str) -> pb_grpc.PeerStub | None:
        """The stub of a live peer, or None."""
        peer = self.peers.get(address)
        return peer.stub if peer is not None and peer.up else None

    def others(self) -> list[tuple[str, PeerState]]:
        """Every peer entry but this daemon's own addresses, by address."""
        return [(a, p) for a, p in sorted(self.peers.items()) if a not in self.self_addresses]

    def metadata(self) -> tuple[tuple[str, bytes], ...]:
        return ((TOKEN_KEY, self.token),)

    def authenticate(self, context: Any, what: str) -> None:
        """Server side of every Peer call: the caller must hold our token."""
        got = b""
        for key, value in context.invocation_metadata() or ():
            if key == TOKEN_KEY and isinstance(value, bytes):
                got = value
        if not secrets.compare_digest(got, self.token):
            log.warning(
                "refused peer %s from %s: %s",
                what,
                context.peer(),
                "no peer token" if not got else "wrong peer token",
            )
            raise PermissionDeniedError(
                "peer token mismatch: this daemon was started with another --peer-token-file"
            )

    # -- inbound (server side) --------------------------------------------------------

    def on_hello(self, hello: pb.PeerHello, origin: str) -> pb.PeerHello:
        if hello.protocol_version != PROTOCOL_VERSION:
            log.warning(
                "refused peer %s (%s): it speaks relayd protocol %d, we speak %d",
                hello.node_id,
                origin,
                hello.protocol_version,
                PROTOCOL_VERSION,
            )
            raise VersionMismatchError(
                f"peer speaks relayd protocol {hello.protocol_version}, node "
                f"{self.settings.node_id} speaks {PROTOCOL_VERSION}; upgrade the older daemon"
            )
        if hello.node_id and hello.node_id != self.settings.node_id and hello.peer_address:
            # It can pull from us only if we can reach it too: dial back.
            self.ensure_peer(hello.peer_address)
            peer = self.peers[hello.peer_address]
            if not peer.up or peer.epoch != hello.daemon_epoch:
                peer.wake.set()
            elif peer.node_id == hello.node_id:
                # It handshakes again only after it took us for lost, which voided
                # the push grant it gave us (we may not have noticed the outage).
                self.events.greeted_again(peer)
                peer.wake.set()
        return self.hello()

    def on_heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        peer = self.by_node.get(req.node_id)
        if peer is not None and peer.up and peer.epoch == req.daemon_epoch:
            self._set_stages(peer, req.stages)
        return pb.HeartbeatResponse(
            node_id=self.settings.node_id,
            daemon_epoch=self.epoch,
            stages=self.local_stages(),
        )

    # -- dialling ---------------------------------------------------------------------

    async def _resolve_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            named: set[str] = set()
            complete = True
            for entry in self.settings.peers:
                try:
                    addresses = await loop.run_in_executor(None, _resolve, entry)
                except (OSError, ValueError) as exc:
                    log.warning("cannot resolve peer %s: %s", entry, exc)
                    complete = False
                    continue
                named.update(addresses)
                for address in addresses:
                    self.ensure_peer(address)
            self._named |= named
            if complete:  # a name that failed to resolve says nothing of its addresses
                await self._drop_unnamed(self._named - named)
            await asyncio.sleep(RESOLVE_INTERVAL)

    async def _drop_unnamed(self, unnamed: set[str]) -> None:
        """Stop dialling addresses the names no longer give (a replaced pod of a headless
        service), once they are down: else every address a name ever gave is dialled
        for good. A daemon there that dials us is dialled back again."""
        for address in unnamed:
            peer = self.peers.get(address)
            if peer is not None and peer.up:
                continue  # goes once it is down and still unnamed
            self._named.discard(address)
            if peer is None:
                continue
            del self.peers[address]
            if peer.node_id and self.by_node.get(peer.node_id) is peer:
                del self.by_node[peer.node_id]
            log.info(
                "peer %s is no longer named by --peers and is down; no longer dialled", address
            )
            if peer.task is not None:
                peer.task.cancel()
                await asyncio.gather(peer.task, return_exceptions=True)
            if peer.channel is not None:
                await peer.channel.close()

    def ensure_peer(self, address: str) -> None:
        if self._closed or address in self.self_addresses or address in self.peers:
            return
        peer = PeerState(address)
        self.peers[address] = peer
        peer.task = asyncio.get_running_loop().create_task(
            self._peer_loop(peer), name=f"relayd-peer {address}"
        )

    async def _peer_loop(self, peer: PeerState) -> None:
        backoff = 0.1
        options = channel_options(self.settings.peer_timeout)
        peer.channel = grpc.aio.insecure_channel(peer.address, options=options)
        peer.stub = pb_grpc.PeerStub(peer.channel)
        while not self._closed:
            delay = self.heartbeat_interval
            try:
                if not peer.up:
                    if await self._handshake(peer):
                        return  # it was ourselves
                    backoff = 0.1
                else:
                    beat = pb.HeartbeatRequest(
                        node_id=self.settings.node_id,
                        daemon_epoch=self.epoch,
                        stages=self.local_stages(),
                    )
                    resp = await self.call(peer, "Heartbeat", beat)
                    if resp.daemon_epoch != peer.epoch:
                        self._down(peer, f"restarted (epoch {peer.epoch} -> {resp.daemon_epoch})")
                        continue
                    self._set_stages(peer, resp.stages)
                if peer.up:
                    await self.events.beat(peer)
            except grpc.RpcError as exc:
                err = from_rpc_error(exc)
                self._down(peer, err.message or str(err))
                delay = _REFUSED_BACKOFF if isinstance(err, PermissionDeniedError) else backoff
                backoff = min(backoff * 2, _MAX_BACKOFF)
            except RelayError as exc:
                self._down(peer, exc.message or str(exc))
                delay = _REFUSED_BACKOFF
            peer.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(peer.wake.wait(), timeout=delay)

    async def _handshake(self, peer: PeerState) -> bool:
        """Returns True when the address turned out to be this daemon itself."""
        resp = await self.call(peer, "Handshake", self.hello())
        if resp.node_id == self.settings.node_id:
            if resp.daemon_epoch != self.epoch:
                raise PeerConfigError(
                    f"peer {peer.address} has our node id {resp.node_id!r}; give every "
                    "daemon its own --node-id"
                )
            log.info("peer entry %s is this daemon; skipping it", peer.address)
            self.self_addresses.add(peer.address)
            return True
        if resp.protocol_version != PROTOCOL_VERSION:
            raise VersionMismatchError(
                f"peer speaks relayd protocol {resp.protocol_version}, we speak "
                f"{PROTOCOL_VERSION}; upgrade the older daemon"
            )
        other = self.by_node.get(resp.node_id)
        if other is not None and other is not peer and other.up:
            raise PeerConfigError(
                f"peers {other.address} and {peer.address} both claim node id {resp.node_id!r}"
            )
        peer.node_id = resp.node_id
        peer.epoch = resp.daemon_epoch
        peer.mooncake_session = resp.mooncake_session
        peer.notice_port = resp.notice_port if resp.notice_port <= 65535 else 0
        peer.slot_size = resp.slot_size
        peer.segments = {s.index: s for s in resp.segments}
        peer.last_error = ""
        peer.up = True
        self.by_node[peer.node_id] = peer
        self._set_stages(peer, resp.stages)
        log.info(
            "peer %s up: node %s, epoch %s, mooncake %s",
            peer.address,
            peer.node_id,
            peer.epoch,
            peer.mooncake_session,
        )
        return False

    def _down(self, peer: PeerState, reason: str) -> None:
        if peer.up or peer.last_error != reason:
            log.warning("peer %s (node %s) down: %s", peer.address, peer.node_id or "?", reason)
        peer.last_error = reason
        if peer.up and peer.node_id:
            self.peer_stages(peer.node_id, None)
        self.events.lost(peer)
        peer.forget_identity()

    def _set_stages(self, peer: PeerState, stages: Iterable[str]) -> None:
        """The stages a peer serves go into the node's registry: the router then tells
        a reader on another node (mooncake) from one nobody serves yet."""
        new = tuple(sorted(set(list(stages)[:1024])))
        if new != peer.stages or not peer.stages:
            peer.stages = new
            self.peer_stages(peer.node_id, new)

    # -- lookups ----------------------------------------------------------------------

    def peer_for(self, m: pb.DataRef) -> PeerState:
        node = m.origin.node_id
        peer = self.by_node.get(node)
        if peer is None:
            raise PeerUnavailableError(
                f"DataRef comes from node {node!r}, which is not a connected peer of "
                f"{self.settings.node_id!r} (list it in --peers on either side)"
            )
        if not peer.up:
            raise PeerUnavailableError(
                f"peer node {node!r} ({peer.address}) is down: {peer.last_error or 'unreachable'}"
            )
        if m.origin.daemon_epoch != peer.epoch:
            raise StaleEpochError(
                f"DataRef comes from daemon epoch {m.origin.daemon_epoch!r} of node {node!r}; "
                f"that daemon restarted (now {peer.epoch!r}) and its data is gone"
            )
        return peer

    def serving(self, stage: str) -> PeerState | None:
        """A live peer that serves ``stage`` (the first by address when several do)."""
        for _address, peer in sorted(self.peers.items()):
            if peer.up and stage in peer.stages:
                return peer
        return None


__all__ = [
    "LinkEvents",
    "PeerConfigError",
    "PeerLinks",
    "PeerState",
    "channel_options",
    "keepalive_ms",
    "keepalive_options",
    "load_token",
    "server_options",
]
