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

from ..shares import Shares

# In all; for one lease from the sessions of one uid (peers and discards from
# other nodes share one such share); and from one session for one lease (a
# reader sends a claim and a release; two reads of one DataRef racing in one
# process, twice that). A session past its share is misbehaving and is closed.
# The lease's share is per uid: the next id of a grant is easy to guess, and a
# share for the lease in all let another uid's sessions fill it first, so the
# early Release of the reader it is addressed to went unheard.
MAX_EARLY = 1 << 16
MAX_EARLY_PER_LEASE = 8
MAX_EARLY_PER_SESSION = 4
# ... and from the sessions of one uid, in all. A session may name any id of
# any live grant not announced yet, and a uid may hold half the daemon's
# sessions: without a share of its own one uid could fill the table, and every
# other reader's early Release would go unheard (its lease held to the TTL).
# An honest reader parks a few hundred at most: what its writers' lingering
# frames hold back.
MAX_EARLY_PER_UID = MAX_EARLY // 4
# Parked notices whose lease is not published within this long are dropped.
EARLY_DEADLINE = 10.0


class EarlyKind(enum.Enum):
    CLAIM = "claim"
    RELEASE = "release"
    PEER = "peer"  # a peer pulled the lease for a reader of ``stages``
    DISCARD = "discard"  # a session serving ``stages`` discarded it unread
    OWN = "own"  # the daemon frees it itself (a put nobody will hear of)


@dataclasses.dataclass(frozen=True, slots=True)
class Early:
    kind: EarlyKind
    session_id: str  # "" from a peer, a discard or the daemon
    generation: int
    at: float
    stages: tuple[str, ...]  # the stages the notice was sent for
    uid: int = -1  # the sending session's; -1 from a peer, a discard or the daemon


class EarlyNotices:
    def __init__(self) -> None:
        self._by_lease: dict[int, list[Early]] = {}
        self._count = 0  # entries in all the lists
        self._per_uid: Shares[int] = Shares()

    def __bool__(self) -> bool:
        return bool(self._by_lease)

    def from_session(self, lease_id: int, session_id: str) -> int:
        return sum(1 for e in self._by_lease.get(lease_id, ()) if e.session_id == session_id)

    def from_uid(self, uid: int) -> int:
        return self._per_uid[uid]

    def park(self, lease_id: int, early: Early) -> bool:
        """Hold ``early`` until ``lease_id`` is published; False when full."""
        held = self._by_lease.setdefault(lease_id, [])
        uid = early.uid
        if self._count >= MAX_EARLY or sum(e.uid == uid for e in held) >= MAX_EARLY_PER_LEASE:
            if not held:
                del self._by_lease[lease_id]
            return False
        held.append(early)
        self._count += 1
        if early.uid >= 0:
            self._per_uid.add(early.uid)
        return True

    def _drop(self, lease_id: int) -> list[Early]:
        early = self._by_lease.pop(lease_id)
        self._count -= len(early)
        for e in early:
            if e.uid >= 0:
                self._per_uid.take(e.uid)
        return early

    def pop(self, lease_id: int) -> list[Early]:
        """What was parked for ``lease_id`` (now published), in arrival order."""
        if lease_id not in self._by_lease:
            return []
        return self._drop(lease_id)

    def expire(self, now: float) -> None:
        for lid in [k for k, v in self._by_lease.items() if now - v[0].at > EARLY_DEADLINE]:
            self._drop(lid)
