"""Daemon lifecycle: ``startup()`` -> ``main_loop()`` -> ``shutdown()``.

The shape follows uvicorn's ``Server``: signals only set flags; the main loop
runs housekeeping until a stop is requested; shutdown drains (health goes
NOT_SERVING, new reservations are refused, in-flight leases get a grace
period) and then releases everything it created. A second SIGTERM/SIGINT
cuts the grace period short.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import time
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from relayd_client.wire.dataref import MAX_REF_BYTES
from relayd_client.wire.framing import NOTICE_LINGER_S
from relayd_client.wire.keepalive import KEEPALIVE_MS as CLIENT_KEEPALIVE_MS
from relayd_client.wire.proto import relay_pb2_grpc as pb_grpc

from . import __version__, preflight, rundir
from ._systemd import SystemdNotifier
from .config import Settings
from .counts import ReclaimCounts, TransferCounts
from .edges import EdgeStats
from .keys import KeyIndex, LeaseKey
from .metrics import Metrics
from .peer_context import PeerHooks
from .peer_links import PeerConfigError, keepalive_options
from .peers import PeerManager
from .pools import cuda as cuda_pools
from .pools.arena import Arena, remove_stale_segments
from .pools.leases import LeaseManager
from .pools.records import Hooks
from .pools.sessions import BIND_DEADLINE
from .routing.topology import Topology
from .rpc.admission import Admission, Roles
from .rpc.fetch import Fetcher
from .rpc.keyed import KeyedCalls
from .rpc.limits import UidLimits
from .rpc.service import MAX_UNBOUND_SESSIONS, NodeFacts, RelayService
from .rpc.session import SessionHooks, SessionProtocol
from .status import DaemonState, NodeStatus

log = logging.getLogger(__name__)

HOUSEKEEPING_INTERVAL = 0.5
# Besides the packed bytes of the largest put, a socket-fallback message carries
# its DataRef (at most MAX_REF_BYTES) and framing.
_MESSAGE_OVERHEAD = MAX_REF_BYTES + (64 << 10)
# While a client has a call open, the server pings it every GRPC_KEEPALIVE_MS and
# drops it when an answer takes over GRPC_KEEPALIVE_TIMEOUT_MS.
GRPC_KEEPALIVE_MS = 60_000
GRPC_KEEPALIVE_TIMEOUT_MS = 20_000
# How often a client's channel may ping the daemon while nothing else crosses: it
# pings after wire.keepalive.KEEPALIVE_MS of silence while a call of it waits, its
# timer at times a little early, so half that. gRPC's default (5 minutes) takes the
# third such ping for abuse and ends the connection (GOAWAY too_many_pings),
# failing the waiting call. Pings on a connection without calls stay refused (no
# keepalive_permit_without_calls): the client sends none.
GRPC_CLIENT_PING_MIN_MS = CLIENT_KEEPALIVE_MS // 2


def max_message_bytes(arena: Arena) -> int:
    """The largest legitimate message: a socket-fallback put of the largest run the arena has."""
    return arena.max_run_slots() * arena.slot_size + _MESSAGE_OVERHEAD


def segment_mode(admission: Admission) -> int:
    """Who may open the arena's files: exactly who is admitted, never more.

    The files belong to the daemon's uid and group, so the file system lets in
    root, that uid and the group's members (primary or supplementary); all of
    them are admitted. The group gets read-write only when the daemon's group
    is an admitted one; members of other --allow-gid groups are admitted but
    cannot map, and move bytes over the socket fallback.
    """
    return 0o660 if os.getegid() in admission.gids else 0o600


def grpc_server_options(settings: Settings, arena: Arena) -> list[tuple[str, int]]:
    """Bounds on every gRPC connection, bound to a session or not.

    gRPC does not tell the daemon who connects, so these bound connections as
    such: a handshake and any idle spell end at the bind deadline, the number of
    connections is capped at --max-sessions (every client holds one) plus room
    for clients between Attach and bind and for operators, and no
    message may exceed the largest legitimate one (the socket fallback's put).
    """
    limit = max_message_bytes(arena)
    deadline_ms = int(BIND_DEADLINE * 1000)
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.server_handshake_timeout_ms", deadline_ms),
        ("grpc.max_connection_idle_ms", deadline_ms),
        ("grpc.max_allowed_incoming_connections", settings.max_sessions + MAX_UNBOUND_SESSIONS),
        *keepalive_options(GRPC_KEEPALIVE_MS, GRPC_KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.min_ping_interval_without_data_ms", GRPC_CLIENT_PING_MIN_MS),
    ]


@contextlib.contextmanager
def binding(setting: str, address: str) -> Iterator[None]:
    """Bind the server of ``setting``: a port taken since preflight probed it fails
    as preflight fails (:class:`~relayd.preflight.PreflightError`), not as a traceback."""
    try:
        yield
    except (OSError, RuntimeError) as exc:  # RuntimeError: gRPC's "Failed to bind"
        failure = preflight.check_tcp_address(setting, address)
        if failure is None:  # the port binds now: the failure was something else
            raise
        raise preflight.PreflightError([failure]) from exc


class Daemon:
    def __init__(self, settings: Settings, *, notifier: SystemdNotifier | None = None) -> None:
        self.settings = settings
        self.epoch = secrets.token_hex(5)
        self.state = DaemonState.STARTING
        self.started = time.monotonic()
        self.notifier = notifier or SystemdNotifier(None, None)
        self.metrics = Metrics()
        self.edges = EdgeStats(settings.max_edge_labels)
        self.transfers = TransferCounts(self.metrics, self.edges)
        self.reclaims = ReclaimCounts(self.metrics)
        self.roles = Roles()
        # Built by startup(), in this order.
        self.arena: Arena
        self.manager: LeaseManager
        self.topology: Topology
        self.keys: KeyIndex
        self.keyed: KeyedCalls
        self.fetcher: Fetcher
        self.node_status: NodeStatus
        self.service: RelayService
        self.health = health.aio.HealthServicer()
        self._servers: list[grpc.aio.Server] = []
        self._session_server: asyncio.AbstractServer | None = None
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._grace = settings.drain_grace
        self._lock = rundir.SocketLock(
            settings.socket, settings.session_socket, settings.socket_mode
        )
        self._protocols: set[SessionProtocol] = set()
        self.admission = Admission(
            settings.allow_uid,
            settings.allow_gid or (os.getegid(),),
            daemon_uid=os.geteuid(),
            admin_gids=settings.admin_gid,
            stage_owners=dict(settings.stage_owner),
        )
        self.cuda_pools: list[cuda_pools.CudaPool] = []
        # Cross-node peers and Mooncake; None unless --peer-address is set.
        self.peers: PeerManager | None = None

    async def run(self) -> int:
        self._install_signals()
        try:
            await self.startup()
            await self.main_loop()
        finally:
            await self.shutdown()
        return 0

    async def startup(self) -> None:
        """Own the socket, build every part, serve, then join the peers (if any)."""
        self._lock.acquire()
        remove_stale_segments()
        self._build()
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set("relayd.v1.Relay", health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._serve_relay()
        await self._serve_sessions()
        await self._serve_health_and_metrics()
        await self._start_peers()
        # Everything built so far lives as long as the daemon: no full
        # collection needs to walk it again.
        frozen = self.metrics.freeze_gc()

        s = self.settings
        self.state = DaemonState.SERVING
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("relayd.v1.Relay", health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "relayd %s serving on %s: arena %d bytes in %d segments, slot %d, epoch %s, "
            "%d startup objects frozen",
            __version__,
            s.socket,
            self.arena.capacity_bytes,
            len(self.arena.segments),
            s.slot_size,
            self.epoch,
            frozen,
        )
        self.notifier.ready(f"serving on {s.socket}")

    def _build(self) -> None:
        """The memory, the lease table and every part that reads them, wired narrowly."""
        s = self.settings
        admission = self.admission
        self.arena = Arena(
            node_id=s.node_id,
            epoch=self.epoch,
            total_bytes=s.shm_pool_size,
            segment_bytes=s.shm_segment_size,
            slot_size=s.slot_size,
            mode=segment_mode(admission),
        )
        # One slot pool per GPU, only with --gpu-pool-size and CUDA present.
        self.cuda_pools = cuda_pools.open_pools(
            s, prefix=self.arena.prefix, mode=segment_mode(admission)
        )
        m = self.metrics
        self.manager = LeaseManager(
            self.arena,
            pools={p.name: p for p in self.cuda_pools},
            grant_bytes=s.grant_size,
            lease_ttl=s.lease_ttl,
            stage_quota_bytes=s.stage_quota_bytes,
            max_sessions=s.max_sessions,
            max_session_grants=s.max_session_grants,
            max_grant_waits=s.max_grant_waits,
            freed_linger=NOTICE_LINGER_S,
            gpu_work_may_run=cuda_pools.gpu_work_may_run if self.cuda_pools else None,
            hooks=Hooks(
                reclaimed=self.reclaims,
                transfer=self.transfers.count,
                reserve_wait=m.reserve_wait.observe,
            ),
        )
        self.topology = Topology(
            s.node_id,
            self.arena,
            self.manager.session_table,
            on_socket_session=m.socket_fallback.inc,
            on_stages=self.edges.attached,
        )
        self.keys = KeyIndex(max_stage_keys=s.max_stage_keys, ttl=s.lease_ttl)
        self.keyed = KeyedCalls(
            s.node_id,
            self.epoch,
            leases=self.manager,
            keys=self.keys,
            served_here=self.topology.registry.served_here,
        )
        self.fetcher = Fetcher(s.node_id, self.epoch, default_timeout=s.reserve_timeout)
        self.node_status = NodeStatus(
            node_id=s.node_id,
            epoch=self.epoch,
            started=self.started,
            state=lambda: self.state,
            leases=self.manager,
            arena=self.arena,
            gpu_pools=self.cuda_pools,
            topology=self.topology,
            edges=self.edges,
            transfers=self.transfers,
            reclaims=self.reclaims,
            roles=self.roles,
        )
        loop = asyncio.get_running_loop()
        m.attach_state(lambda: self.node_status.snapshot_threadsafe(loop))
        m.attach_edges(self.edges)
        m.watch_gc()
        self.service = RelayService(
            self.manager,
            facts=NodeFacts(
                node_id=s.node_id,
                epoch=self.epoch,
                session_socket=s.session_socket,
                pin_host_memory=s.pin_host_memory,
                lease_ttl=s.lease_ttl,
                peer_address=s.peer_address,
            ),
            reserve_timeout=s.reserve_timeout,
            arena=self.arena,
            gpu_pools=self.cuda_pools,
            topology=self.topology,
            keys=self.keys,
            fetcher=self.fetcher,
            status=self.node_status.status,
            roles=self.roles,
            lifecycle=self,
            on_ref=self.transfers.ref,
        )

    async def _serve_relay(self) -> None:
        s = self.settings
        server = grpc.aio.server(options=grpc_server_options(s, self.arena))
        pb_grpc.add_RelayServicer_to_server(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        with self._lock.creating():
            server.add_insecure_port(f"unix:{s.socket}")
            await server.start()
        os.chmod(s.socket, s.socket_mode)
        self._servers.append(server)

    async def _serve_sessions(self) -> None:
        s, m = self.settings, self.metrics
        limits = UidLimits(s.uid_session_limit)
        hooks = SessionHooks(
            refused=lambda reason: m.refused.labels(reason).inc(),
            report=self.transfers.report,
            latency=self.transfers.latency,
            bound=self.topology.bound,
            closed=self.topology.closed,
            ref=self.transfers.ref,
            fetch=self.fetcher.on_session,
        )
        loop = asyncio.get_running_loop()
        with self._lock.creating():
            self._session_server = await loop.create_unix_server(
                lambda: self._track(
                    SessionProtocol(
                        self.manager,
                        self.admission,
                        hooks,
                        limits=limits,
                        keyed=self.keyed,
                        roles=self.roles,
                    )
                ),
                path=s.session_socket,
            )
        os.chmod(s.session_socket, s.socket_mode)

    async def _serve_health_and_metrics(self) -> None:
        s, m = self.settings, self.metrics
        if s.health_address:
            hs = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, hs)
            # An empty host is every interface (preflight and the metrics port read
            # it so too); gRPC refuses one that names no host.
            host, _, health_port = s.health_address.rpartition(":")
            with binding("health_address", s.health_address):
                hs.add_insecure_port(s.health_address if host else f"0.0.0.0:{health_port}")
            await hs.start()
            self._servers.append(hs)
        if s.metrics_address:
            with binding("metrics_address", s.metrics_address):
                port = m.serve(s.metrics_address)
            log.info("metrics on %s (port %d)", s.metrics_address, port)

    async def _start_peers(self) -> None:
        """Cross-node peers and Mooncake: only with --peer-address."""
        s, m = self.settings, self.metrics
        if s.peers and not s.peer_address:
            raise PeerConfigError(
                "--peers needs --peer-address: peers pull from this node through it"
            )
        if s.peer_address:
            self.peers = PeerManager(
                s,
                epoch=self.epoch,
                arena=self.arena,
                leases=self.manager,
                hooks=PeerHooks(
                    local_stages=self.topology.registry.local_stages,
                    peer_stages=self.topology.peer_stages,
                    pull_seconds=m.pull_seconds.observe,
                    keyed_from_peer=self.keyed.put_from_peer,
                    keyed_withdraw=self.keyed.withdraw_from_peer,
                    aborted=self.keys.abort,
                ),
            )
            # The parts that reach a peer learn of it before it serves anyone.
            self.keyed.peers = self.fetcher.peers = self.peers
            self.service.peers = self.node_status.peers = self.peers
            # Nothing in start() raises after the peer port is bound: a port the probe
            # finds taken is one the bind found taken.
            with binding("peer_address", s.peer_address):
                await self.peers.start()

    async def main_loop(self) -> None:
        interval = HOUSEKEEPING_INTERVAL
        wd = self.notifier.watchdog_interval()
        if wd is not None:
            interval = min(interval, wd)
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=interval)
            try:
                self.manager.reap()
                self.keys.reap(self._lease_alive)
            except Exception:  # the sweep owns no session: log it, keep serving every other
                log.exception("housekeeping sweep failed")
            self.notifier.watchdog()

    async def shutdown(self) -> None:
        if self.state is DaemonState.STOPPED:
            return
        if not self._lock.held:
            # Start-up stopped before it owned the socket (another daemon holds
            # it): this process started nothing, so it reports no stop either.
            self.state = DaemonState.STOPPED
            return
        was_serving = hasattr(self, "manager")
        self.state = DaemonState.DRAINING
        if was_serving:
            self.notifier.stopping()
            await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            await self.health.set("relayd.v1.Relay", health_pb2.HealthCheckResponse.NOT_SERVING)
            self.manager.start_drain()
            deadline = time.monotonic() + self._grace
            # In-flight leases get the grace period to be read; polling keeps the
            # hot path free of drain bookkeeping.
            while (
                self.manager.in_flight and time.monotonic() < deadline and not self._force.is_set()
            ):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._force.wait(), timeout=0.05)
                self.manager.reap()
            left = self.manager.in_flight
            if left:
                log.warning("drain grace over with %d leases in flight; reclaiming them", left)
            self.manager.drop_all()
            self.manager.flush()
        for server in self._servers:
            await server.stop(grace=0.5)
        if self._session_server is not None:
            self._session_server.close()
            for proto in list(self._protocols):
                proto.stop()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._session_server.wait_closed(), timeout=2)
        # Mooncake must stop writing into the arena before it is unmapped.
        if self.peers is not None:
            await self.peers.close()
        self.metrics.close()
        if hasattr(self, "manager"):
            self.manager.releases.close()  # no timed read of a ring after this
        for pool in self.cuda_pools:
            pool.close()  # header segments go before the arena's lock
        self.cuda_pools.clear()
        if hasattr(self, "arena"):
            self.arena.close()
        self._lock.release()
        self.state = DaemonState.STOPPED
        log.info("relayd stopped")

    @property
    def drain_grace(self) -> float:
        """The grace the drain gives in-flight leases (a Drain call may have changed it)."""
        return self._grace

    def request_stop(self, *, grace: float | None = None) -> None:
        """A Drain call. One on a daemon already draining changes nothing: its
        reply reports the grace under way, and cutting it short is a second
        signal's job, never a repeated (perhaps retried) call's."""
        if self._stop.is_set():
            return
        if grace is not None:
            self._grace = grace
        self._stop.set()

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        if self._stop.is_set():
            log.warning("second %s: cutting the drain short", signal.Signals(sig).name)
            self._force.set()
        else:
            log.info("%s: draining", signal.Signals(sig).name)
            self._stop.set()

    def _track(self, proto: SessionProtocol) -> SessionProtocol:
        self._protocols.add(proto)
        original = proto.connection_lost

        def lost(exc: Exception | None) -> None:
            self._protocols.discard(proto)
            original(exc)

        proto.connection_lost = lost  # type: ignore[method-assign]
        return proto

    def _lease_alive(self, lease: LeaseKey) -> bool:
        """Whether a keyed entry's lease may still be read (leases of other nodes: their TTL)."""
        node, lease_id = lease
        return node != self.settings.node_id or lease_id in self.manager.leases


__all__ = ["Daemon"]
