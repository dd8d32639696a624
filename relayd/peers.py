"""Peer daemons: who they are, whether they answer, and the cross-node pull.

Started by the daemon only when ``--peer-address`` is set. It then owns:

* the Mooncake transport (one engine, the whole arena registered once at start);
* the ``relayd.v1.Peer`` gRPC server on ``--peer-address`` (TCP);
* one dial loop per peer address: handshake (protocol version, shared token,
  node identity, Mooncake session, arena geometry, stages), then heartbeats
  every ``peer_timeout / 4`` (at most 1 s). A failed heartbeat marks the peer
  down at once; the loop keeps re-dialling (backing off to 1 s, 5 s after a
  refused token), so a restarted peer is picked up with its new epoch and
  Mooncake session without restarting anything here;
* per-peer credits (:class:`~relayd.transports.credits.CreditPool`).

Peers are named by their Peer-service address ``host:port`` (metrics label
``peer``). ``--peers`` entries may be DNS names resolving to several addresses
(a Kubernetes headless service); they are re-resolved every
``RESOLVE_INTERVAL`` seconds, and our own address and node id are skipped.
A daemon that dials us is dialled back, so one side listing the other is
enough.

The pull (:meth:`PeerManager.fetch`, on the reader's node): check the DataRef
against the writer's arena geometry learned at handshake, reserve a local run,
take a credit of that peer, pull through Mooncake, then pull the writer's
16-byte slot header (into the spare bytes past the local data): the generation
check. Generations are never reused and the writer's daemon zeroes a header
before the slots can be reused, so a header still holding the DataRef's
generation after the copy means the bytes were never overwritten during it.
Only then is the local lease published to the reader; ``ReleaseRemote`` then
frees the writer's lease in the background (measured: a Peer round trip costs
~1 ms on the 2-core reference machine, the 16-byte pull ~0.25 ms).

Authentication: every Peer call carries the token from ``--peer-token-file``
in the ``relayd-peer-token-bin`` metadata, compared in constant time. The link
itself is plaintext gRPC: the token keeps out daemons (and tools) that were not
given it, not an attacker who can sniff the cluster network (see the README).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import dataclasses
import logging
import os
import secrets
import socket
import stat
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import grpc
from relayd_client.wire.dataref import DataRef
from relayd_client.wire.errors import (
    AbortedError,
    CorruptRefError,
    InvalidArgumentError,
    PeerUnavailableError,
    PermissionDeniedError,
    RelayError,
    SessionClosedError,
    StaleEpochError,
    StaleRefError,
    VersionMismatchError,
)
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.proto import relay_pb2_grpc as pb_grpc
from relayd_client.wire.shm import HEADER_STRIDE, SHM_POOL, SLOT_HEADER
from relayd_client.wire.status import from_rpc_error
from relayd_client.wire.transport import Transport
from relayd_client.wire.version import PROTOCOL_VERSION

from .peer_context import PeerHooks, PeerLeases
from .peer_notices import PeerNotifier
from .pools.records import Lease
from .pools.sessions import Session, SessionState
from .push import PushManager
from .transports.base import (
    MemoryRegion,
    PullError,
    PullOp,
    PullTimeoutError,
    RemoteTransport,
    split_ops,
)
from .transports.credits import CreditPool

if TYPE_CHECKING:
    from .config import Settings
    from .pools.arena import Arena

log = logging.getLogger(__name__)

TOKEN_KEY = "relayd-peer-token-bin"
RESOLVE_INTERVAL = 10.0
_REFUSED_BACKOFF = 5.0
_MAX_BACKOFF = 1.0
_ABORT_ORIGINS = 4096
# Frees and releases to a peer wait this long to share one Notify call (a landed
# notice, which a reader waits for, takes along whatever is pending then).
NOTICE_LINGER_S = 0.025


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


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _resolve(entry: str) -> list[str]:
    """``host:port`` -> every address it names (a headless service names several)."""
    host, port = _split(entry)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({_join(str(info[4][0]), port) for info in infos})


def segment_address(mm: Any) -> int:
    """Base address of a mapping; the ctypes view is dropped at once so the
    mapping can still be closed at shutdown."""
    view = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(view)
    finally:
        del view


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
        self.segments = {}
        self.stages = ()


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
        self.arena = arena
        self.leases = leases
        self.hooks = hooks or PeerHooks()
        self.token = load_token(self.settings.peer_token_file)
        if transport is None:
            from .transports.mooncake import MooncakeTransport

            transport = MooncakeTransport(self.settings)
        self.transport = transport
        self.credits = CreditPool(self.settings.peer_credits)
        self.peers: dict[str, PeerState] = {}
        self.by_node: dict[str, PeerState] = {}
        self.local_bases: list[int] = []
        self.heartbeat_interval = min(1.0, max(self.settings.peer_timeout / 4, 0.05))
        self._server: grpc.aio.Server | None = None
        self._resolver: asyncio.Task[None] | None = None
        self._closed = False
        self._self_addresses: set[str] = set()
        # request id -> peers its pulled leases came from, so abort reaches them.
        self._origins: collections.OrderedDict[str, set[str]] = collections.OrderedDict()
        self._background: set[asyncio.Task[Any]] = set()
        self.push = PushManager(self)
        self.notifier = PeerNotifier(
            self.settings.node_id,
            epoch,
            self._stub_for,
            self.metadata,
            self.settings.peer_timeout,
            NOTICE_LINGER_S,
        )

    def _stub_for(self, address: str) -> pb_grpc.PeerStub | None:
        peer = self.peers.get(address)
        return peer.stub if peer is not None and peer.up else None

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        from .rpc.peer_service import PeerService

        await self.transport.start()
        for seg in self.arena.segments:
            base = segment_address(seg.mm)
            await self.transport.register(MemoryRegion(seg.name, base, seg.size))
            self.local_bases.append(base)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_PeerServicer_to_server(PeerService(self), server)
        port = server.add_insecure_port(self.settings.peer_address)
        await server.start()
        self._server = server
        self._self_addresses.add(self.settings.peer_address)
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
        if self.settings.peers:
            self._resolver = asyncio.get_running_loop().create_task(
                self._resolve_loop(), name="relayd-peer-resolver"
            )

    async def close(self) -> None:
        self._closed = True
        tasks = [p.task for p in self.peers.values() if p.task is not None]
        if self._resolver is not None:
            tasks.append(self._resolver)
        tasks.extend(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.push.close()
        await self.notifier.close()
        for peer in self.peers.values():
            if peer.channel is not None:
                await peer.channel.close()
        if self._server is not None:
            await self._server.stop(grace=0.5)
        await self.transport.close()

    # -- who we are -------------------------------------------------------------------

    def local_stages(self) -> list[str]:
        return sorted({st for s in self.leases.sessions.values() for st in s.stages})

    def hello(self) -> pb.PeerHello:
        arena = self.arena
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
                for seg, base in zip(arena.segments, self.local_bases, strict=True)
            ],
            stages=self.local_stages(),
        )

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
            self._ensure_peer(hello.peer_address)
            peer = self.peers[hello.peer_address]
            if not peer.up or peer.epoch != hello.daemon_epoch:
                peer.wake.set()
            elif peer.node_id == hello.node_id:
                # It handshakes again only after it took us for lost, which voided
                # the push grant it gave us (we may not have noticed the outage).
                self.push.grant_void(peer)
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
            for entry in self.settings.peers:
                try:
                    addresses = await loop.run_in_executor(None, _resolve, entry)
                except (OSError, ValueError) as exc:
                    log.warning("cannot resolve peer %s: %s", entry, exc)
                    continue
                for address in addresses:
                    self._ensure_peer(address)
            await asyncio.sleep(RESOLVE_INTERVAL)

    def _ensure_peer(self, address: str) -> None:
        if self._closed or address in self._self_addresses or address in self.peers:
            return
        peer = PeerState(address)
        self.peers[address] = peer
        peer.task = asyncio.get_running_loop().create_task(
            self._peer_loop(peer), name=f"relayd-peer {address}"
        )

    async def _peer_loop(self, peer: PeerState) -> None:
        backoff = 0.1
        peer.channel = grpc.aio.insecure_channel(peer.address, options=[("grpc.enable_retries", 0)])
        peer.stub = pb_grpc.PeerStub(peer.channel)
        timeout = self.settings.peer_timeout
        while not self._closed:
            delay = self.heartbeat_interval
            try:
                if not peer.up:
                    if await self._handshake(peer):
                        return  # it was ourselves
                    backoff = 0.1
                else:
                    resp = await peer.stub.Heartbeat(
                        pb.HeartbeatRequest(
                            node_id=self.settings.node_id,
                            daemon_epoch=self.epoch,
                            stages=self.local_stages(),
                        ),
                        timeout=timeout,
                        metadata=self.metadata(),
                    )
                    if resp.daemon_epoch != peer.epoch:
                        self._down(peer, f"restarted (epoch {peer.epoch} -> {resp.daemon_epoch})")
                        continue
                    self._set_stages(peer, resp.stages)
                if peer.up and self.push.enabled and peer.address not in self.push.out:
                    # Off every path: right after the handshake, then on each beat
                    # until the peer has room (it may not have dialled us back yet).
                    await self.push.ask_grant(peer)
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
        assert peer.stub is not None
        resp = await peer.stub.Handshake(
            self.hello(), timeout=self.settings.peer_timeout, metadata=self.metadata()
        )
        if resp.node_id == self.settings.node_id:
            if resp.daemon_epoch != self.epoch:
                raise PeerConfigError(
                    f"peer {peer.address} has our node id {resp.node_id!r}; give every "
                    "daemon its own --node-id"
                )
            log.info("peer entry %s is this daemon; skipping it", peer.address)
            self._self_addresses.add(peer.address)
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
            self.hooks.peer_stages(peer.node_id, None)
        self.push.peer_down(peer)
        self.notifier.forget(peer.address)
        peer.forget_identity()

    def _set_stages(self, peer: PeerState, stages: Iterable[str]) -> None:
        """The stages a peer serves go into the node's registry: the router then tells
        a reader on another node (mooncake) from one nobody serves yet."""
        new = tuple(sorted(set(list(stages)[:1024])))
        if new != peer.stages or not peer.stages:
            peer.stages = new
            self.hooks.peer_stages(peer.node_id, new)

    # -- the pull (reader's side) -----------------------------------------------------

    def _peer_for(self, m: pb.DataRef) -> PeerState:
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

    def _ops(self, peer: PeerState, remote: pb.LeaseRef, local: Lease) -> list[PullOp]:
        seg = peer.segments.get(remote.segment)
        if seg is None:
            raise CorruptRefError(
                f"DataRef names segment {remote.segment} the writer does not have"
            )
        if (
            remote.nslots == 0
            or remote.slot + remote.nslots > seg.nslots
            or remote.length > remote.nslots * peer.slot_size
            or remote.offset != seg.data_offset + remote.slot * peer.slot_size
        ):
            raise CorruptRefError("DataRef lease lies outside the writer's arena")
        arena = self.arena
        lseg = arena.segments[local.run.segment]
        local_addr = self.local_bases[local.run.segment] + lseg.slot_offset(local.run.slot)
        remote_addr = seg.base + remote.offset
        ops = split_ops(local_addr, remote_addr, remote.length)
        # Last: the writer's slot header, into the 16 bytes past the local data.
        header = seg.base + remote.slot * HEADER_STRIDE
        ops.append(PullOp(local_addr + remote.length, header, HEADER_STRIDE))
        return ops

    def _scratch(self, local: Lease, length: int) -> tuple[int, int]:
        seg = self.arena.segments[local.run.segment]
        gen, nbytes = SLOT_HEADER.unpack_from(seg.mm, seg.slot_offset(local.run.slot) + length)
        return int(gen), int(nbytes)

    async def fetch(self, session: Session, data: bytes, timeout: float) -> pb.LeaseRef:
        """Pull a foreign DataRef into this arena; returns the local lease."""
        ref = DataRef.from_bytes(data)
        m = ref.proto
        if m.to_stage not in session.stages:
            raise PermissionDeniedError(
                f"DataRef is addressed to stage {m.to_stage!r}; the session serves {session.stages}"
            )
        if ref.transport is not Transport.SHM:
            raise InvalidArgumentError(f"{ref.transport.value} DataRefs cannot be fetched")
        if m.origin.node_id == self.settings.node_id:
            raise InvalidArgumentError("the DataRef is from this node; read it directly")
        req = self.leases.requests.get(m.request_id)
        if req is not None and req.aborted:
            raise AbortedError(f"request {m.request_id!r} was aborted")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pushed = await self.push.take(m, deadline)
        if pushed is not None:
            return self._lease_ref(pushed, pushed.nbytes)
        peer = self._peer_for(m)
        remote = m.lease
        # 16 bytes past the data hold the writer's slot header, read back after the copy.
        local = await self.leases.reserve_for_pull(
            session,
            remote.length + HEADER_STRIDE,
            max(deadline - loop.time(), 0.0),
            request_id=m.request_id,
            from_stage=m.origin.stage,
            to_stage=m.to_stage,
        )
        ops: list[PullOp] = []
        try:
            ops = self._ops(peer, remote, local)
            body, check = ops[:-1], ops[-1:]
            self._note_origin(m.request_id, peer.address)
            await self._pull(peer, body, check, deadline)
            if self._scratch(local, remote.length) != (remote.generation, remote.length):
                raise StaleRefError(
                    f"the lease was read, reclaimed or aborted on node {peer.node_id!r} while "
                    "it was pulled; data discarded"
                )
            if session.state is SessionState.CLOSED:
                # The reader died during the pull: nobody would ever release the lease.
                raise SessionClosedError("the reader's session closed during the pull")
            self.leases.publish_pull(local, remote.length)
            self.push.pulled(peer.address, phases=len([p for p in (body, check) if p]))
        except BaseException:
            # The run is ours alone, so whatever Mooncake still has in flight into
            # it is this pull's: free it only once that has stopped.
            quarantine = asyncio.ensure_future(self.transport.wait_settled(ops)) if ops else None
            self._drop_after(local, quarantine)
            raise
        # The copy is verified: the writer's lease can go, off the reader's path,
        # batched with the other notices to that peer.
        # It frees the lease only for a reader of the stage it is addressed to.
        self.notifier.box(peer.address).released.add(
            lease_id=remote.lease_id, generation=remote.generation, reader_stages=session.stages
        )
        self.notifier.send(peer.address, urgent=False)
        return self._lease_ref(local, remote.length)

    def _lease_ref(self, local: Lease, length: int) -> pb.LeaseRef:
        seg = self.arena.segments[local.run.segment]
        return pb.LeaseRef(
            pool=SHM_POOL,
            segment=local.run.segment,
            slot=local.run.slot,
            nslots=local.run.nslots,
            offset=seg.slot_offset(local.run.slot),
            length=length,
            generation=local.generation,
            lease_id=local.id,
        )

    async def _pull(
        self, peer: PeerState, body: list[PullOp], check: list[PullOp], deadline: float
    ) -> None:
        """``check`` starts once ``body`` has landed, all under one credit."""
        loop = asyncio.get_running_loop()
        async with self.credits.acquire(peer.address, max(deadline - loop.time(), 0.0)) as credit:
            peer.in_flight += 1
            peer.in_flight_max = max(peer.in_flight_max, peer.in_flight)
            start = time.perf_counter()
            settle: asyncio.Future[Any] | None = None
            try:
                budget = min(max(deadline - loop.time(), 0.0), self.settings.peer_timeout)
                await self.transport.pull(peer.mooncake_session, body, timeout=budget, then=check)
            except PullError as err:
                if err.in_flight:
                    settle = err.settled
                if isinstance(err, PullTimeoutError) and budget >= self.settings.peer_timeout:
                    # peer_timeout, not the reader's own deadline, ran out: the peer
                    # stopped answering, which is what a dead peer is to the reader.
                    raise PeerUnavailableError(
                        f"peer {peer.address} did not answer within peer_timeout "
                        f"({self.settings.peer_timeout:g}s): {err}"
                    ) from err
                raise
            except asyncio.CancelledError:
                # Bytes may still land: keep the run and the credit until they stop.
                settle = asyncio.ensure_future(self.transport.wait_settled(body + check))
                raise
            finally:
                peer.in_flight -= 1
                if settle is not None:
                    credit.release_when(settle)
            self.hooks.pull_seconds(time.perf_counter() - start)

    def _drop_after(self, lease: Lease, quarantine: asyncio.Future[Any] | None) -> None:
        leases = self.leases

        def drop(_: Any = None) -> None:
            leases.drop_pull(lease)
            leases.flush()

        if quarantine is None or quarantine.done():
            drop()
        else:
            log.warning("pull into lease %d still in flight; its run stays quarantined", lease.id)
            quarantine.add_done_callback(drop)

    # -- keyed delivery and discard (see relayd.rpc.keyed) -----------------------------

    def serving(self, stage: str) -> PeerState | None:
        """A live peer that serves ``stage`` (the first by address when several do)."""
        for _address, peer in sorted(self.peers.items()):
            if peer.up and stage in peer.stages:
                return peer
        return None

    async def keyed_put(self, peer: PeerState, key: str, data_ref: bytes) -> None:
        """Hand a keyed DataRef to the peer that serves its consumer; its errors are ours."""
        if peer.stub is None:
            raise PeerUnavailableError(f"peer {peer.address} is not connected")
        try:
            await peer.stub.KeyedPut(
                pb.PeerKeyedPutRequest(node_id=self.settings.node_id, key=key, data_ref=data_ref),
                timeout=self.settings.peer_timeout,
                metadata=self.metadata(),
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    async def release_now(self, m: pb.DataRef) -> bool:
        """Free a lease of another node now (a discard); False when it was gone already.
        A lease pushed here is freed here: the writer's node freed its own on landing."""
        if self.push.discard(m):
            return True
        peer = self._peer_for(m)
        if peer.stub is None:
            raise PeerUnavailableError(f"peer {peer.address} is not connected")
        try:
            resp = await peer.stub.ReleaseRemote(
                pb.ReleaseRemoteRequest(
                    lease_id=m.lease.lease_id,
                    generation=m.lease.generation,
                    node_id=self.settings.node_id,
                    discard=True,
                ),
                timeout=self.settings.peer_timeout,
                metadata=self.metadata(),
            )
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
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

    async def abort_remote(self, request_id: str) -> int:
        """Tell every live peer (the origins of this request's pulls first of all)."""
        self.push.abort(request_id)
        targets = {p.address for p in self.peers.values() if p.up}
        targets |= self._origins.pop(request_id, set())
        calls = [self._abort_one(self.peers[a], request_id) for a in targets if a in self.peers]
        results = await asyncio.gather(*calls)
        return sum(results)

    async def _abort_one(self, peer: PeerState, request_id: str) -> int:
        if peer.stub is None:
            return 0
        try:
            resp = await peer.stub.AbortRemote(
                pb.AbortRemoteRequest(request_id=request_id, node_id=self.settings.node_id),
                timeout=self.settings.peer_timeout,
                metadata=self.metadata(),
            )
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

    def snapshot(self) -> dict[str, dict[str, float]]:
        credits = self.credits.stats()
        in_use: dict[str, float] = {}
        capacity: dict[str, float] = {}
        up: dict[str, float] = {}
        for address, peer in self.peers.items():
            if address in self._self_addresses:
                continue
            c = credits.get(address)
            in_use[address] = c.in_use if c else 0
            capacity[address] = self.credits.capacity(address)
            up[address] = 1 if peer.up else 0
        return {"credits_in_use": in_use, "credits_capacity": capacity, "peer_up": up}

    def status(self) -> list[pb.PeerStatus]:
        out = []
        for address, peer in sorted(self.peers.items()):
            if address in self._self_addresses:
                continue
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
                    **self.push.status(address),
                )
            )
        return out


__all__ = ["PeerConfigError", "PeerManager", "PeerState", "load_token"]
