"""Where each session runs, the node's stage registry, and the route of every edge.

Who calls what (all on the daemon's event loop):

* ``bound`` - when a session's socket binds: the daemon places the session
  (:class:`~relayd.routing.router.Placement`) from facts it established itself - the
  peer's pid from SO_PEERCRED, that process's start time and namespaces from
  /proc, and whether the client echoed the nonce the daemon wrote into its
  arena (it maps the daemon's memory) - and registers its stages.
* ``closed`` - when the session's socket closes: its stages are unregistered.
* ``route`` - from the ``Route`` RPC, once per edge and registry version on
  each writer: :func:`relayd.routing.router.route` on the registry's placements.

Every change of the registry is pushed to every session as an Event of kind
``EVENT_KIND_REGISTRY`` carrying the new version; clients drop their cached routes.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Iterable

from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.shm import PROBE_BYTES, probe_offset_for
from relayd_client.wire.transport import Transport

from ..pools.arena import Arena
from ..pools.cuda import peer_access as gpu_peer_access
from ..pools.events import RegistryChanged
from ..pools.sessions import Session, Sessions
from .registry import StageRegistry
from .router import PayloadFacts, Placement, route

log = logging.getLogger(__name__)


def process_key(pid: int) -> str:
    """Unique per OS process on this host, as the daemon sees it (pid reuse included).

    Empty when the process cannot be identified (SO_PEERCRED gives 0 for a
    peer outside the daemon's pid namespace, or /proc is not readable): the
    caller must then never treat two sessions as one process.
    """
    if pid <= 0:
        return ""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        # The command name may hold spaces and parens; fields resume after the last ')'.
        start = stat[stat.rindex(b")") + 2 :].split()[19].decode()
        ns = os.readlink(f"/proc/{pid}/ns/pid")
    except (OSError, IndexError, ValueError):
        return ""
    return f"{ns}:{pid}:{start}"


class Topology:
    def __init__(
        self,
        node_id: str,
        arena: Arena,
        sessions: Sessions,
        *,
        on_socket_session: Callable[[], None] = lambda: None,
        on_stages: Callable[[Iterable[str]], None] = lambda stages: None,
    ) -> None:
        self.node_id = node_id
        self.sessions = sessions
        self.registry = StageRegistry(node_id)
        self._on_socket_session = on_socket_session
        # Stages that attached here or at a peer: the only names metrics label.
        self._on_stages = on_stages
        self._can_map: dict[str, bool] = {}
        self._placements: dict[str, Placement] = {}
        self._pids: dict[str, int] = {}
        # One nonce per daemon: it proves "maps this arena", which is all
        # routing needs; it is never sent over any socket by the daemon.
        self.nonce = secrets.token_bytes(PROBE_BYTES)
        seg = arena.segments[0]
        self.probe_offset = probe_offset_for(seg.nslots)
        seg.mm[self.probe_offset : self.probe_offset + PROBE_BYTES] = self.nonce

    # -- sessions -------------------------------------------------------------------

    def bound(self, session: Session, shm_nonce: bytes, pid: int) -> tuple[str, int]:
        """Place and register a freshly bound session; returns (data path, registry version)."""
        can_map = len(shm_nonce) == PROBE_BYTES and secrets.compare_digest(shm_nonce, self.nonce)
        # An unidentifiable process is its own process: no local_object with anyone.
        key = process_key(pid) or f"session:{session.id}"
        try:
            gpus = tuple(session.gpu_uuids)
            placement = Placement(
                node_id=self.node_id,
                process_key=key,
                ipc_namespace=session.namespaces.get("ipc", ""),
                can_map_shm=can_map,
                gpu_uuids=gpus,
                stages=session.stages,
            )
        except ValueError as exc:  # GPU ordinals instead of UUIDs: route as CPU-only
            log.warning("session %s: %s; ignoring its GPUs for routing", session.id, exc)
            placement = Placement(
                self.node_id, key, session.namespaces.get("ipc", ""), can_map,
                (), session.stages,
            )  # fmt: skip
        self._can_map[session.id] = can_map
        self._placements[session.id] = placement
        self._pids[session.id] = pid
        if not can_map:
            log.warning(
                "session %s (pid %d) cannot map the arena: socket fallback",
                session.id,
                pid,
                extra={"session_id": session.id},
            )
            self._on_socket_session()
        self.registry.register(session.id, placement)
        self._on_stages(session.stages)
        self._broadcast(skip=session.id)
        path = Transport.SHM if can_map else Transport.SOCKET
        return path.value, self.registry.version

    def closed(self, session_id: str) -> None:
        self._can_map.pop(session_id, None)
        self._placements.pop(session_id, None)
        self._pids.pop(session_id, None)
        if self.registry.unregister(session_id):
            self._broadcast()

    def peer_stages(self, node_id: str, stages: Iterable[str] | None) -> None:
        """A peer daemon serves ``stages`` (None: it is gone); from relayd.peers."""
        if stages is None:
            changed = self.registry.drop_remote(node_id)
        else:
            where = {
                st: Placement(node_id, f"peer:{node_id}", "", False, (), (st,)) for st in stages
            }
            changed = self.registry.update_remote(node_id, where)
            self._on_stages(where)
        if changed:
            self._broadcast()

    def can_map(self, session_id: str) -> bool:
        return self._can_map.get(session_id, True)

    def _broadcast(self, skip: str = "") -> None:
        self.sessions.tell_all(RegistryChanged(self.registry.version), skip=self.sessions.get(skip))

    # -- routing --------------------------------------------------------------------

    def route(self, session: Session, req: pb.RouteRequest) -> pb.RouteResponse:
        writer = self._placement(session)
        facts = PayloadFacts(
            encoded_bytes=req.encoded_bytes,
            inline_meta_bytes=req.inline_meta_bytes,
            has_cpu_tensors=req.has_cpu_tensors,
            is_chunk=req.is_chunk,
            chunk_meta_has_tensor=req.chunk_meta_has_tensor,
            cuda_uuids=_gpu_uuids(req.cuda_uuids),
            direct_allowed=req.allow_cuda_ipc_direct,
        )
        chosen = route(
            writer, self.registry.lookup(req.to_stage), facts, peer_access=gpu_peer_access
        )
        from_stage = req.from_stage if req.from_stage in session.stages else session.stages[0]
        self.registry.note_edge(from_stage, req.to_stage, chosen)
        return pb.RouteResponse(
            transport=pb.Transport.Name(chosen.transport.to_proto()),
            reason=chosen.reason,
            registry_version=self.registry.version,
        )

    def _placement(self, session: Session) -> Placement:
        placement = self._placements.get(session.id)
        if placement is None:  # not bound: callers check BOUND first
            return Placement(self.node_id, f"session:{session.id}", "", True, (), session.stages)
        return placement

    # -- status ---------------------------------------------------------------------

    def fill_status(self, resp: pb.StatusResponse) -> None:
        snap = self.registry.snapshot()
        resp.registry_version = self.registry.version
        stages: dict[str, list[dict[str, object]]] = snap["stages"]  # type: ignore[assignment]
        for stage, entries in stages.items():
            for e in entries:
                resp.stages.append(
                    pb.StageStatus(
                        stage=stage,
                        session_id=str(e["session_id"]),
                        node_id=str(e["node_id"]),
                        process_key=str(e["process_key"]),
                        can_map_shm=bool(e["can_map_shm"]),
                        gpu_uuids=[str(u) for u in e["gpu_uuids"]],  # type: ignore[attr-defined]
                        pid=self._pids.get(str(e["session_id"]), 0),
                    )
                )
        for (src, dst), rec in sorted(self.registry.edges().items()):
            resp.edges.append(
                pb.EdgeStatus(
                    from_stage=src,
                    to_stage=dst,
                    transport=pb.Transport.Name(rec.route.transport.to_proto()),
                    reason=rec.route.reason,
                    count=rec.count,
                )
            )
        for s in resp.sessions:
            s.data_path = (Transport.SHM if self.can_map(s.session_id) else Transport.SOCKET).value


def _gpu_uuids(raw: Iterable[str]) -> tuple[str, ...]:
    """The payload's GPUs as the writer named them. Anything that is not a UUID
    is dropped (the router refuses ordinals), so a confused client gets shm."""
    names = {u[:64] for u in list(raw)[:64] if u and not u.startswith("cuda:")}
    return tuple(sorted(u for u in names if not u.strip().isdigit()))
