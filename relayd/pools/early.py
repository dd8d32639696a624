"""Claims and releases that overtook their lease's Publish, held until it lands.

The writer's notices and the reader's travel on different sockets (and the
writer's linger), so a reader can claim or release a lease the daemon has not
heard published yet. What it said is parked here and judged when the Publish
lands; bounded in all, per lease and per session, and dropped after
:data:`EARLY_DEADLINE`.
"""

from __future__ import annotations

import dataclasses
import enum

# In all, for one lease, and from one session for one lease (a reader sends a
# claim and a release; two reads of one DataRef racing in one process, twice
# that). A session past its share is misbehaving and is closed.
MAX_EARLY = 1 << 16
MAX_EARLY_PER_LEASE = 8
MAX_EARLY_PER_SESSION = 4
# Parked notices whose lease is not published within this long are dropped.
EARLY_DEADLINE = 10.0


class EarlyKind(enum.Enum):
    CLAIM = "claim"
    RELEASE = "release"
    PEER = "peer"  # a peer pulled the lease for a reader of ``stages``
    DISCARD = "discard"  # a holder of the DataRef discarded it unread


@dataclasses.dataclass(frozen=True, slots=True)
class Early:
    kind: EarlyKind
    session_id: str  # "" from a peer or a discard
    generation: int
    at: float
    stages: tuple[str, ...]  # the stages the notice was sent for


class EarlyNotices:
    def __init__(self) -> None:
        self._by_lease: dict[int, list[Early]] = {}
        self._count = 0  # entries in all the lists

    def __bool__(self) -> bool:
        return bool(self._by_lease)

    def from_session(self, lease_id: int, session_id: str) -> int:
        return sum(1 for e in self._by_lease.get(lease_id, ()) if e.session_id == session_id)

    def park(self, lease_id: int, early: Early) -> bool:
        """Hold ``early`` until ``lease_id`` is published; False when full."""
        held = self._by_lease.setdefault(lease_id, [])
        if len(held) >= MAX_EARLY_PER_LEASE or self._count >= MAX_EARLY:
            if not held:
                del self._by_lease[lease_id]
            return False
        held.append(early)
        self._count += 1
        return True

    def pop(self, lease_id: int) -> list[Early]:
        """What was parked for ``lease_id`` (now published), in arrival order."""
        early = self._by_lease.pop(lease_id, None)
        if early is None:
            return []
        self._count -= len(early)
        return early

    def expire(self, now: float) -> None:
        for lid in [k for k, v in self._by_lease.items() if now - v[0].at > EARLY_DEADLINE]:
            self._count -= len(self._by_lease.pop(lid))
