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
import enum
import fcntl
import logging
import os
import secrets
import signal
import time
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Counter
from relayd_client.wire.dataref import MAX_REF_BYTES
from relayd_client.wire.errors import PeerUnavailableError, SessionClosedError
from relayd_client.wire.latency import BOUNDS as LATENCY_BOUNDS
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.proto import relay_pb2_grpc as pb_grpc
from relayd_client.wire.shm import SHM_POOL
from relayd_client.wire.transport import Transport

from . import __version__, rundir
from ._systemd import SystemdNotifier
from .config import Settings
from .edges import EdgeStats
from .keys import KeyIndex, LeaseKey
from .metrics import Metrics
from .peer_context import PeerHooks
from .peer_links import PeerConfigError
from .peers import PeerManager
from .pools import cuda as cuda_pools
from .pools.arena import Arena, remove_stale_segments
from .pools.leases import LeaseManager
from .pools.records import Hooks, LeaseState, ReclaimReason
from .pools.sessions import BIND_DEADLINE, Session, SessionState
from .routing.topology import Topology
from .rpc.keyed import KeyedCalls
from .rpc.limits import UidLimits
from .rpc.service import MAX_UNBOUND_SESSIONS, RelayService
from .rpc.session import Admission, SessionProtocol

log = logging.getLogger(__name__)

HOUSEKEEPING_INTERVAL = 0.5
# Freed notices to a writer are batched this long (LeaseManager.flush says
# why), as clients batch theirs (the client's NOTICE_LINGER_S).
FREED_LINGER_S = 0.025
MAX_FETCH_TIMEOUT = 3600.0
# Besides the packed bytes of the largest put, a socket-fallback message carries
# its DataRef (at most MAX_REF_BYTES) and framing.
_MESSAGE_OVERHEAD = MAX_REF_BYTES + (64 << 10)
GRPC_KEEPALIVE_MS = 60_000
GRPC_KEEPALIVE_TIMEOUT_MS = 20_000


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
        ("grpc.keepalive_time_ms", GRPC_KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", GRPC_KEEPALIVE_TIMEOUT_MS),
    ]


class DaemonState(enum.Enum):
    """Where the daemon is in its lifecycle; one to one with ``relayd.v1.DaemonState``."""

    STARTING = pb.DAEMON_STATE_STARTING
    SERVING = pb.DAEMON_STATE_SERVING
    DRAINING = pb.DAEMON_STATE_DRAINING
    STOPPED = pb.DAEMON_STATE_STOPPED


class SocketInUseError(RuntimeError):
    """Another live daemon serves on the requested socket."""


class Daemon:
    def __init__(self, settings: Settings, *, notifier: SystemdNotifier | None = None) -> None:
        self.settings = settings
        self.epoch = secrets.token_hex(5)
        self.state = DaemonState.STARTING
        self.started = time.monotonic()
        self.notifier = notifier or SystemdNotifier(None, None)
        self.metrics = Metrics()
        self._transfer_children: dict[str, tuple[Counter, Counter]] = {}
        self.edges = EdgeStats(settings.max_edge_labels)
        self.arena: Arena
        self.manager: LeaseManager
        self.topology: Topology
        self.keys: KeyIndex
        self.keyed = KeyedCalls(self)
        self.health = health.aio.HealthServicer()
        self._servers: list[grpc.aio.Server] = []
        self._session_server: asyncio.AbstractServer | None = None
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._grace = settings.drain_grace
        self._lock_fd = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._protocols: set[SessionProtocol] = set()
        self.admission = Admission(
            settings.allow_uid,
            settings.allow_gid or (os.getegid(),),
            daemon_uid=os.geteuid(),
            admin_gids=settings.admin_gid,
        )
        # Bound sessions whose process may operate the daemon (Drain, the full Status).
        self.admins: set[str] = set()
        # Bound operator sessions (the CLI's); status leaves them out.
        self.operators: set[str] = set()
        self.cuda_pools: list[cuda_pools.CudaPool] = []
        # Cross-node peers and Mooncake; None unless --peer-address is set.
        self.peers: PeerManager | None = None

    # -- lifecycle ----------------------------------------------------------------

    async def run(self) -> int:
        self._loop = asyncio.get_running_loop()
        self._install_signals()
        try:
            await self.startup()
            await self.main_loop()
        finally:
            await self.shutdown()
        return 0

    async def startup(self) -> None:
        s = self.settings
        self._take_socket_lock()
        remove_stale_segments()
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
            freed_linger=FREED_LINGER_S,
            gpu_work_may_run=cuda_pools.gpu_work_may_run if self.cuda_pools else None,
            hooks=Hooks(
                reclaimed=lambda reason, n: m.reclaimed.labels(reason.value).inc(n),
                transfer=self._count_transfer,
                reserve_wait=m.reserve_wait.observe,
            ),
        )
        for reason in ReclaimReason:
            m.reclaimed.labels(reason.value)
        self.topology = Topology(
            s.node_id,
            self.arena,
            self.manager.session_table,
            on_socket_session=m.socket_fallback.inc,
            on_stages=self.edges.attached,
        )
        self.keys = KeyIndex(max_stage_keys=s.max_stage_keys, ttl=s.lease_ttl)
        m.attach_state(self._snapshot_threadsafe)
        m.attach_edges(self.edges)
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set("relayd.v1.Relay", health_pb2.HealthCheckResponse.NOT_SERVING)

        server = grpc.aio.server(options=grpc_server_options(s, self.arena))
        pb_grpc.add_RelayServicer_to_server(RelayService(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        with self._umask():
            server.add_insecure_port(f"unix:{s.socket}")
            await server.start()
        os.chmod(s.socket, s.socket_mode)
        self._servers.append(server)

        limits = UidLimits(s.uid_session_limit)
        loop = asyncio.get_running_loop()
        with self._umask():
            self._session_server = await loop.create_unix_server(
                lambda: self._track(
                    SessionProtocol(
                        self.manager,
                        admission,
                        on_refused=lambda r: m.refused.labels(r).inc(),
                        on_report=self._on_report,
                        on_latency=self._on_latency,
                        on_bound=self.topology.bound,
                        on_closed=self.topology.closed,
                        on_ref=self.count_ref,
                        on_fetch=self._fetch_on_session,
                        limits=limits,
                        keyed=self.keyed,
                        admins=self.admins,
                        operators=self.operators,
                    )
                ),
                path=s.session_socket,
            )
        os.chmod(s.session_socket, s.socket_mode)

        if s.health_address:
            hs = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, hs)
            hs.add_insecure_port(s.health_address)
            await hs.start()
            self._servers.append(hs)
        if s.metrics_address:
            port = m.serve(s.metrics_address)
            log.info("metrics on %s (port %d)", s.metrics_address, port)

        # Cross-node peers and Mooncake: only with --peer-address.
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
                    peer_stages=self.topology.peer_stages,
                    pull_seconds=m.pull_seconds.observe,
                    keyed_from_peer=self.keyed.put_from_peer,
                    aborted=self.keys.abort,
                ),
            )
            await self.peers.start()

        self.state = DaemonState.SERVING
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("relayd.v1.Relay", health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "relayd %s serving on %s: arena %d bytes in %d segments, slot %d, epoch %s",
            __version__,
            s.socket,
            self.arena.capacity_bytes,
            len(self.arena.segments),
            s.slot_size,
            self.epoch,
        )
        self.notifier.ready(f"serving on {s.socket}")

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
        if self._lock_fd < 0:
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
                if proto.transport is not None:
                    proto.transport.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._session_server.wait_closed(), timeout=2)
        # Mooncake must stop writing into the arena before it is unmapped.
        if self.peers is not None:
            await self.peers.close()
        self.metrics.close()
        for pool in self.cuda_pools:
            pool.close()  # header segments go before the arena's lock
        self.cuda_pools = []
        if hasattr(self, "arena"):
            self.arena.close()
        for path in (self.settings.socket, self.settings.session_socket):
            with contextlib.suppress(FileNotFoundError):
                if self._lock_fd >= 0:
                    os.unlink(path)
        self._release_socket_lock()
        self.state = DaemonState.STOPPED
        log.info("relayd stopped")

    @property
    def drain_grace(self) -> float:
        """The grace the drain gives in-flight leases (a Drain call may have changed it)."""
        return self._grace

    def request_stop(self, *, grace: float | None = None) -> None:
        if grace is not None:
            self._grace = grace
        if self._stop.is_set():
            self._force.set()
        self._stop.set()

    # -- signals --------------------------------------------------------------------

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

    # -- socket ownership -----------------------------------------------------------

    @contextlib.contextmanager
    def _umask(self) -> Any:
        old = os.umask(0o777 & ~self.settings.socket_mode)
        try:
            yield
        finally:
            os.umask(old)

    def _take_socket_lock(self) -> None:
        """One daemon per socket: an flock beside it, released by the kernel if we die."""
        path = self.settings.socket
        rundir.prepare(os.path.dirname(path), self.settings.socket_mode)
        fd = rundir.open_lock(path + ".lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise SocketInUseError(
                f"another relayd (pid {owner or '?'}) is serving on {path}; stop it or pick "
                "another --socket"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        # Whatever socket files exist belong to a dead daemon: replace them.
        for stale in (path, self.settings.session_socket):
            rundir.check_leftover(stale)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)

    def _release_socket_lock(self) -> None:
        if self._lock_fd >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.settings.socket + ".lock")
            os.close(self._lock_fd)
            self._lock_fd = -1

    # -- sessions & metrics helpers ---------------------------------------------------

    def _track(self, proto: SessionProtocol) -> SessionProtocol:
        self._protocols.add(proto)
        original = proto.connection_lost

        def lost(exc: Exception | None) -> None:
            self._protocols.discard(proto)
            original(exc)

        proto.connection_lost = lost  # type: ignore[method-assign]
        return proto

    # -- cross-node reads: one implementation for gRPC Fetch and the session's FetchCall --

    def fetch_timeout(self, asked: float) -> float:
        """The budget of a fetch that asked for ``asked`` seconds (<= 0 or NaN: default)."""
        return min(asked, MAX_FETCH_TIMEOUT) if asked > 0 else self.settings.reserve_timeout

    async def fetch(self, session: Session, data_ref: bytes, timeout: float) -> pb.FetchResponse:
        """Pull a foreign DataRef into this arena for ``session`` (see relayd.peers)."""
        if session.state is not SessionState.BOUND:
            raise SessionClosedError("bind the session socket before fetching")
        if self.peers is None:
            raise PeerUnavailableError(
                "this daemon has no peers (--peer-address is not set); cross-node DataRefs "
                "cannot be read here"
            )
        lease = await self.peers.fetch(session, data_ref, timeout)
        return pb.FetchResponse(lease=lease, node_id=self.settings.node_id, daemon_epoch=self.epoch)

    async def _fetch_on_session(
        self, session: Session, data_ref: bytes, asked: float
    ) -> pb.FetchResponse:
        return await self.fetch(session, data_ref, self.fetch_timeout(asked))

    def _lease_alive(self, lease: LeaseKey) -> bool:
        """Whether a keyed entry's lease may still be read (leases of other nodes: their TTL)."""
        node, lease_id = lease
        return node != self.settings.node_id or lease_id in self.manager.leases

    def _count_transfer(
        self, transport: str, count: int, nbytes: int, from_stage: str, to_stage: str
    ) -> None:
        """One place counts every transfer, node-wide and per edge, exactly once."""
        self.edges.count(from_stage, to_stage, transport, count, nbytes)
        # Once per transfer: labels() costs more than the rest of a publish.
        children = self._transfer_children.get(transport)
        if children is None:
            children = self._transfer_children[transport] = (
                self.metrics.transfers.labels(transport),
                self.metrics.transfer_bytes.labels(transport),
            )
        children[0].inc(count)
        children[1].inc(nbytes)
        if transport == Transport.INLINE.value:
            self.metrics.inline_tensor_bytes.inc(nbytes)

    def _on_report(self, session: Session, rep: pb.TransferReport) -> None:
        """A client's batch of transfers the daemon never saw (inline, local_object, ...)."""
        if self.edges.check_report(session.stages, rep):
            self._count_transfer(
                Transport.from_proto(rep.transport).value,
                rep.count,
                rep.bytes,
                rep.from_stage,
                rep.to_stage,
            )

    def _on_latency(self, session: Session, rep: pb.EdgeLatencyReport) -> None:
        self.edges.add_latency(session.stages, rep)

    def count_ref(self, nbytes: int) -> None:
        """A forwarded tensor reference was published (RelayClient.ref)."""
        self.metrics.refs.inc()
        self.metrics.ref_bytes.inc(nbytes)

    def _snapshot_threadsafe(self) -> dict[str, Any]:
        """Scrapes run on the HTTP thread; the state belongs to the loop."""
        loop = self._loop
        if loop is None or not hasattr(self, "manager"):
            return {"pools": [], "leases": {}, "sessions": 0, "serving": 0}
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is loop:
                return self.snapshot()

        async def snap() -> dict[str, Any]:
            return self.snapshot()

        return asyncio.run_coroutine_threadsafe(snap(), loop).result(timeout=5)

    def snapshot(self) -> dict[str, Any]:
        m, a = self.manager, self.arena
        by_state = m.leases_by_state()
        return {
            "pools": [
                {
                    "name": SHM_POOL,
                    "capacity_bytes": a.capacity_bytes,
                    "used_bytes": m.lease_slots() * a.slot_size,
                    "granted_bytes": m.granted_slots() * a.slot_size,
                    "largest_free_run_bytes": a.largest_free_run() * a.slot_size,
                    "slot_size": a.slot_size,
                    "slots": a.capacity_slots,
                    "free_slots": a.free_slots,
                }
            ]
            + [
                cuda_pools.pool_status(p, m.lease_slots(p.name), m.granted_slots(p.name))
                for p in self.cuda_pools
            ],
            "leases": {(SHM_POOL, st.name.lower()): n for st, n in by_state.items()}
            | {
                (p.name, st.name.lower()): n
                for p in self.cuda_pools
                for st, n in m.leases_by_state(p.name).items()
            },
            "sessions": len(m.sessions) - len(self.operators),
            "serving": 1 if self.state is DaemonState.SERVING else 0,
            **(self.peers.snapshot() if self.peers is not None else {}),
        }

    def status(self) -> pb.StatusResponse:
        m = self.manager
        now = time.monotonic()
        snap = self.snapshot()
        resp = pb.StatusResponse(
            node_id=self.settings.node_id,
            daemon_epoch=self.epoch,
            state=self.state.value,
            uptime_seconds=now - self.started,
            version=__version__,
        )
        for p in snap["pools"]:
            resp.pools.append(pb.PoolStatus(**p))
        for (_pool, state), n in snap["leases"].items():
            resp.leases_by_state[state] += n  # summed over the arena and GPU pools
        leases = sorted(m.leases.values(), key=lambda lease: lease.created)
        for lease in leases[:1000]:
            resp.leases.append(
                pb.LeaseStatus(
                    lease_id=lease.id,
                    state=f"LEASE_STATE_{lease.state.name}",
                    pool=lease.run.pool,
                    bytes=lease.nbytes or lease.run.nslots * self.arena.slot_size,
                    request_id=lease.request_id,
                    from_stage=lease.from_stage,
                    to_stage=lease.to_stage,
                    age_seconds=now - lease.created,
                    session_id=lease.writer,
                )
            )
        for s in m.sessions.values():
            if s.id in self.operators:
                continue
            resp.sessions.append(
                pb.SessionStatus(
                    session_id=s.id,
                    pid=s.pid,
                    stages=list(s.stages),
                    granted_bytes=s.granted_slots * self.arena.slot_size,
                    leases=sum(len(g.leases) for g in s.grants.values()),
                    age_seconds=now - s.created,
                    uid=max(s.uid, 0),
                )
            )
        for sample in next(iter(self.metrics.transfers.collect())).samples:
            if sample.name.endswith("_total") and sample.value:
                resp.transfers_by_transport[sample.labels["transport"]] = int(sample.value)
        if self.peers is not None:
            resp.peers.extend(self.peers.status())
        for sample in next(iter(self.metrics.reclaimed.collect())).samples:
            if sample.name.endswith("_total") and sample.value:
                resp.reclaimed_by_reason[sample.labels["reason"]] = int(sample.value)
        self.topology.fill_status(resp)
        resp.edge_traffic.extend(self.edges.status())
        resp.latency_bucket_bounds.extend(LATENCY_BOUNDS)
        return resp


__all__ = ["Daemon", "DaemonState", "LeaseState", "SocketInUseError"]
