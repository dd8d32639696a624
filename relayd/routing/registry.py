"""The node's stage registry: which process serves which stage, here and on peers.

The daemon owns one :class:`StageRegistry`. Sessions register on Attach and
unregister when their session socket closes; peers send their whole local table
(``update_remote``) and are dropped when they go away (``drop_remote``). Route
lookups read it; ``relayd status`` shows :meth:`StageRegistry.snapshot`.

``version`` grows by one on every change of who serves what. Clients cache one
:class:`~relayd.routing.router.Route` per edge and recompute it when the version they
last saw differs, so a change that does not alter the table (a peer re-sending
the same stages) must not bump it, and noting an edge's route (an observation,
not topology) never does - otherwise every noted route would invalidate every
cache.

Not thread-safe: the daemon calls it from its event loop only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .router import Placement, Route

# Edge records kept for status. A writer may route to any name, served or not,
# so past this the oldest record goes (one to a stage nobody serves first).
MAX_EDGES = 4096


@dataclass(frozen=True, slots=True)
class StageEntry:
    """One local session serving a stage."""

    session_id: str
    placement: Placement
    attached_at: float  # wall-clock seconds, for status


@dataclass(frozen=True, slots=True)
class EdgeRecord:
    """The last route taken on one from_stage -> to_stage edge."""

    route: Route
    count: int
    last_at: float


@dataclass(frozen=True, slots=True)
class _Remote:
    stages: Mapping[str, Placement]
    updated_at: float


def _placement_json(p: Placement) -> dict[str, object]:
    return {
        "node_id": p.node_id,
        "process_key": p.process_key,
        "ipc_namespace": p.ipc_namespace,
        "can_map_shm": p.can_map_shm,
        "gpu_uuids": list(p.gpu_uuids),
        "stages": list(p.stages),
    }


class StageRegistry:
    """Stage name -> the processes serving it, on this node and on known peers.

    :meth:`lookup` answers with one placement. When several serve a stage it
    picks deterministically:

    * a local session beats a remote one - the shorter path, and the local table
      is exact while the remote one is as old as the peer's last update;
    * among local sessions, the most recent registration. A restarted stage
      attaches as a new session, possibly before the old one's socket EOF has
      been seen; the newest attachment is the one that is alive. Ties cannot
      occur: registration order is kept exactly, not taken from the clock;
    * among peers, the smallest ``node_id``.

    A stage with several live readers in different places (replicas) gets a
    route valid for the one picked; :meth:`lookup_all` lists them all so that a
    caller can tell.
    """

    def __init__(self, node_id: str, *, clock: Callable[[], float] = time.time) -> None:
        self.node_id = node_id
        self.version = 0
        self._clock = clock
        self._sessions: dict[str, StageEntry] = {}
        # Registration order within each list: the last entry is the newest.
        self._by_stage: dict[str, list[StageEntry]] = {}
        self._remote: dict[str, _Remote] = {}
        self._edges: dict[tuple[str, str], EdgeRecord] = {}

    # ------------------------------------------------------------ local sessions

    def register(self, session_id: str, placement: Placement) -> StageEntry:
        """Add a session for every stage in ``placement.stages``; re-registering replaces."""
        if placement.node_id != self.node_id:
            raise ValueError(
                f"local session {session_id!r} placed on node {placement.node_id!r}, "
                f"this is {self.node_id!r}"
            )
        self._remove_session(session_id)
        entry = StageEntry(session_id, placement, self._clock())
        self._sessions[session_id] = entry
        for stage in placement.stages:
            self._by_stage.setdefault(stage, []).append(entry)
        self._prune_edges()
        self.version += 1
        return entry

    def unregister(self, session_id: str) -> bool:
        """Remove a session; False (and no version bump) if it was not registered."""
        if not self._remove_session(session_id):
            return False
        self._prune_edges()
        self.version += 1
        return True

    def _remove_session(self, session_id: str) -> bool:
        entry = self._sessions.pop(session_id, None)
        if entry is None:
            return False
        for stage in entry.placement.stages:
            left = [e for e in self._by_stage.get(stage, ()) if e.session_id != session_id]
            if left:
                self._by_stage[stage] = left
            else:
                self._by_stage.pop(stage, None)
        return True

    def _prune_edges(self) -> None:
        # An edge out of a stage nobody here serves any more is not active.
        for key in [k for k in self._edges if k[0] not in self._by_stage]:
            del self._edges[key]

    # ------------------------------------------------------------ remote stages

    def update_remote(self, node_id: str, stages: Mapping[str, Placement]) -> bool:
        """Replace everything known about peer ``node_id``; True if that changed anything."""
        if node_id == self.node_id:
            raise ValueError(f"peer update for this node's own id {node_id!r}")
        for stage, placement in stages.items():
            if placement.node_id != node_id:
                raise ValueError(
                    f"peer {node_id!r} reports stage {stage!r} on node {placement.node_id!r}"
                )
        new = dict(stages)
        old = self._remote.get(node_id)
        self._remote[node_id] = _Remote(new, self._clock())
        if old is not None and old.stages == new:
            return False  # a periodic re-send; route caches stay valid
        self.version += 1
        return True

    def drop_remote(self, node_id: str) -> bool:
        """Forget peer ``node_id``; False (and no version bump) if it was unknown."""
        if self._remote.pop(node_id, None) is None:
            return False
        self.version += 1
        return True

    # ------------------------------------------------------------ lookups

    def served_here(self, stage: str) -> bool:
        """Whether a data session of this node serves ``stage``: bound, and not an
        operator's (the CLI's moves no data and is never registered)."""
        return stage in self._by_stage

    def local_stages(self) -> list[str]:
        """The stages this node's data sessions serve, sorted (what peers are told)."""
        return sorted(self._by_stage)

    def lookup(self, stage: str) -> Placement | None:
        """The placement to route to for ``stage``, or None if nobody serves it yet."""
        local = self._by_stage.get(stage)
        if local:
            return local[-1].placement
        for node_id in sorted(self._remote):
            placement = self._remote[node_id].stages.get(stage)
            if placement is not None:
                return placement
        return None

    def lookup_all(self, stage: str) -> tuple[Placement, ...]:
        """Every placement serving ``stage``, in :meth:`lookup`'s order of preference."""
        local = [e.placement for e in reversed(self._by_stage.get(stage, ()))]
        remote = [
            self._remote[n].stages[stage] for n in sorted(self._remote)
            if stage in self._remote[n].stages
        ]  # fmt: skip
        return (*local, *remote)

    # ------------------------------------------------------------ edges and status

    def note_edge(self, from_stage: str, to_stage: str, route: Route) -> None:
        """Record the route last taken from ``from_stage`` to ``to_stage`` (no version bump)."""
        key = (from_stage, to_stage)
        # Popped and put back: the dict runs from the least to the most recently noted.
        old = self._edges.pop(key, None)
        if old is None and len(self._edges) >= MAX_EDGES:
            self._evict_edge()
        count = 1 if old is None else old.count + 1
        self._edges[key] = EdgeRecord(route, count, self._clock())

    def _evict_edge(self) -> None:
        # Routes to names nobody serves must not push out edges between stages
        # that are here: the least recently noted of those goes first.
        victim = next((k for k in self._edges if self.lookup(k[1]) is None), None)
        del self._edges[victim if victim is not None else next(iter(self._edges))]

    def edges(self) -> dict[tuple[str, str], EdgeRecord]:
        """Active edges and the last route each took (a copy)."""
        return dict(self._edges)

    def snapshot(self) -> dict[str, object]:
        """A JSON-ready view for ``relayd status``; keys and lists are in a stable order."""
        return {
            "node_id": self.node_id,
            "version": self.version,
            "stages": {
                stage: [
                    {"session_id": e.session_id, "attached_at": e.attached_at,
                     **_placement_json(e.placement)}
                    for e in self._by_stage[stage]
                ]
                for stage in sorted(self._by_stage)
            },
            "remote": {
                node_id: {
                    "updated_at": self._remote[node_id].updated_at,
                    "stages": {
                        stage: _placement_json(p)
                        for stage, p in sorted(self._remote[node_id].stages.items())
                    },
                }
                for node_id in sorted(self._remote)
            },
            "edges": [
                {"from_stage": src, "to_stage": dst, "transport": rec.route.transport.value,
                 "reason": rec.route.reason, "count": rec.count, "last_at": rec.last_at}
                for (src, dst), rec in sorted(self._edges.items())
            ],
        }  # fmt: skip
