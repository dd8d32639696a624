"""What the lease table tells a session: domain events, not wire frames.

The table emits these through each session's :data:`Sink`; the session
socket (:mod:`relayd.rpc.frames`) turns them into ``SessionFrame``s. Keeping
the wire out of here lets the lease rules be driven and checked without
protobuf, and gives the frame layout one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from relayd_client.wire.errors import ErrorCode


@dataclasses.dataclass(frozen=True, slots=True)
class Freed:
    """The writer may reuse these leases' slots."""

    lease_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Aborted:
    """``request_id`` was aborted: refuse puts to it, wake readers waiting for it."""

    request_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class SessionError:
    """A notice of this session was refused; the session stays open."""

    code: ErrorCode
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class Draining:
    """The daemon is draining: no new reservations."""


@dataclasses.dataclass(frozen=True, slots=True)
class Reclaim:
    """Space is short: return idle grants, send the releases held back."""


@dataclasses.dataclass(frozen=True, slots=True)
class RegistryChanged:
    """Which process serves which stage changed; cached routes are stale."""

    version: int


@dataclasses.dataclass(frozen=True, slots=True)
class LocalLease:
    """Where a lease the daemon owns lies, as a reader maps it (a pull's or a push's)."""

    lease_id: int  # also its generation: the one lease of a daemon's grant
    segment: int
    slot: int
    nslots: int
    offset: int
    length: int


@dataclasses.dataclass(frozen=True, slots=True)
class Landed:
    """A push from another node landed as a local lease for a stage this session
    alone serves: its get may read the lease without asking (a hint; the slot
    header decides)."""

    origin: tuple[str, str, int, int]  # (node, epoch, writer's lease id, generation)
    lease: LocalLease
    request_id: str
    to_stage: str


@dataclasses.dataclass(frozen=True, slots=True)
class Declined:
    """A push from another node for a stage this session alone serves will not
    land here: its get fetches now rather than wait for its announcement."""

    origin: tuple[str, str, int, int]  # (node, epoch, writer's lease id, generation)
    to_stage: str


SessionEvent = (
    Freed | Aborted | SessionError | Draining | Reclaim | RegistryChanged | Landed | Declined
)
Sink = Callable[[SessionEvent], None]
