"""The records of the lease table: grants, leases, their states, and the pool they come from.

Plain data with the few rules that belong to one record (a grant's slot map);
who may change them, and when, is in :mod:`relayd.pools.leases`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Collection
from typing import Protocol

from relayd_client.wire.shm import LEASE_SEQ_BITS

from .arena import Run

# A lease id is ``grant id << GEN_SHIFT | n``; the same number is its generation
# (relayd_client.wire.shm says how far each part counts).
GEN_SHIFT = LEASE_SEQ_BITS
# Request ids and stage names kept in a record are cut to this length.
NAME_KEEP = 256
# A slot's byte in a grant's map, by whether a lease covers it.
_FILL = (b"\x00", b"\x01")


def slots_for(nbytes: int, slot_size: int) -> int:
    """The slots ``nbytes`` take (at least one)."""
    return max(1, -(-nbytes // slot_size))


def is_id_of(lease_id: int, grant_id: int) -> bool:
    """Whether ``lease_id`` is one of the ids grant ``grant_id`` numbers its leases with."""
    return lease_id >> GEN_SHIFT == grant_id and bool(lease_id & ((1 << GEN_SHIFT) - 1))


class LeaseState(enum.Enum):
    # The relayd.v1.LeaseState numbers (Status reports them as they are); a
    # unit test checks them against the generated enum.
    RESERVED = 1
    PUBLISHED = 2
    CLAIMED = 3


class ReclaimReason(enum.Enum):
    WRITER_DIED = "writer_died"
    READER_DIED = "reader_died"
    TTL = "ttl"
    ABORT = "abort"
    DRAIN = "drain"


class Pool(Protocol):
    """What the lease rules need of a pool of slots (the arena, a GPU pool)."""

    name: str
    slot_size: int

    @property
    def capacity_bytes(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    def largest_free_run(self) -> int: ...
    def max_run_slots(self) -> int: ...
    def allocate(self, nslots: int) -> Run | None: ...
    def free(self, run: Run) -> None: ...
    def clear_header(self, segment: int, slot: int) -> None: ...
    def header(self, segment: int, slot: int) -> tuple[int, int]: ...


@dataclasses.dataclass(eq=False)
class Grant:
    id: int
    session_id: str
    run: Run
    leases: dict[int, Lease] = dataclasses.field(default_factory=dict)
    orphan: bool = False
    writer_pid: int = 0  # of the session that held it, once it is an orphan
    # Highest lease id reserved in it: the writer numbers its leases upward and
    # announces them in order, so an unknown id at or below this is gone.
    last_lease: int = 0
    # Where a freed lease's run goes instead of back to the pool: a landed push
    # lives in a peer's standing push grant, which gets the run back.
    returns: Callable[[Lease], None] | None = None
    # One byte per slot of the run, set while a lease record covers it: no two
    # live leases of a grant may share a slot, or freeing both frees it twice.
    busy: bytearray = dataclasses.field(init=False, repr=False)
    # ``busy`` written through (see mark()).
    _busy_view: memoryview = dataclasses.field(init=False, repr=False)
    # Set at the first slot of each lease record, which ``starts`` maps to the
    # record: the leases a run overlaps are found without looking at every
    # lease, and marking costs the same at any lease size.
    head: bytearray = dataclasses.field(init=False, repr=False)
    starts: dict[int, Lease] = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.busy = bytearray(self.run.nslots)
        self._busy_view = memoryview(self.busy)
        self.head = bytearray(self.run.nslots)
        self.starts = {}

    def mark(self, run: Run, lease: Lease | None) -> None:
        """``lease`` covers ``run``'s slots now (None: no lease does)."""
        first, n = run.slot - self.run.slot, run.nslots
        covered = lease is not None
        # Twice per transfer: an item, else a slice through a memoryview; a
        # bytearray's own slice assignment costs three times as much.
        if n == 1:
            self.busy[first] = covered
        else:
            self._busy_view[first : first + n] = _FILL[covered] * n
        self.head[first] = covered
        if lease is not None:
            self.starts[first] = lease
        else:
            self.starts.pop(first, None)

    def is_free(self, slot: int, nslots: int) -> bool:
        first = slot - self.run.slot
        return self.busy.find(1, first, first + nslots) < 0

    def overlapping(self, slot: int, nslots: int) -> list[Lease]:
        """The lease records covering any of ``nslots`` slots from ``slot``, in slot order."""
        busy, head, base = self.busy, self.head, self.run.slot
        end = slot - base + nslots
        found: list[Lease] = []
        i = busy.find(1, slot - base, end)
        while i >= 0:
            lease = self.starts[head.rfind(1, 0, i + 1)]  # the record whose run holds slot i
            found.append(lease)
            i = busy.find(1, lease.run.slot - base + lease.run.nslots, end)
        return found

    def first_lease_id(self) -> int:
        """The id of the one lease of a grant the daemon itself fills (a pull, a push)."""
        return (self.id << GEN_SHIFT) | 1


@dataclasses.dataclass(eq=False, slots=True)
class Lease:
    id: int
    generation: int
    grant: Grant
    run: Run
    state: LeaseState
    request_id: str
    from_stage: str
    to_stage: str
    writer: str
    created: float
    published_at: float = 0.0
    nbytes: int = 0
    claimer: str = ""
    # Found sealed in a dead writer's grant with no Reserve/Publish received
    # (see Orphans.adopt_sealed): its request and stages are unknown, so any
    # reader that names its lease id and generation may read and release it.
    adopted: bool = False
    released: bool = False  # freed by a reader's release, not reclaimed (set as it is freed)


def may_discard(lease: Lease, stages: Collection[str]) -> bool:
    """Whether a session serving ``stages`` may free ``lease`` unread: its record
    names one of them as its writer or its addressee. Never the DataRef's fields:
    they are its holder's to fill, and its lease id and generation are guessable.
    An adopted lease's stages are unknown and whoever names it may read it, which
    frees it; a discard frees it no less."""
    return lease.adopted or lease.from_stage in stages or lease.to_stage in stages


@dataclasses.dataclass
class Hooks:
    """Metric callbacks, so the lease table needs no Prometheus import."""

    reclaimed: Callable[[ReclaimReason, int], None] = lambda reason, n: None
    # (transport, count, bytes, from_stage, to_stage)
    transfer: Callable[[str, int, int, str, str], None] = lambda t, n, nbytes, src, dst: None
    reserve_wait: Callable[[float], None] = lambda seconds: None
