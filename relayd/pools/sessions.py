"""Sessions: who is attached, what each may do, and how to tell it something.

A session is created by ``Attach`` (:meth:`Sessions.open`), bound once to its
session-socket connection (:meth:`Sessions.bind`, with the peer's pid, uid and
gid from ``SO_PEERCRED``), and closed when that connection ends. The token is
compared in constant time; a session that never binds is closed after
:data:`BIND_DEADLINE`.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import secrets
from collections.abc import Callable, Collection, Iterable, Iterator

from relayd_client.wire.errors import (
    ErrorCode,
    PermissionDeniedError,
    ResourceExhaustedError,
    SessionClosedError,
)

from .events import SessionError, SessionEvent, Sink
from .records import Grant

log = logging.getLogger(__name__)

BIND_DEADLINE = 10.0


class SessionState(enum.Enum):
    PENDING = "pending"
    BOUND = "bound"
    CLOSED = "closed"


@dataclasses.dataclass(eq=False)
class Session:
    id: str
    token: bytes
    pid: int
    stages: tuple[str, ...]
    created: float
    namespaces: dict[str, str] = dataclasses.field(default_factory=dict)
    gpu_uuids: tuple[str, ...] = ()
    uid: int = -1
    gid: int = -1
    state: SessionState = SessionState.PENDING
    sink: Sink | None = None
    grants: dict[int, Grant] = dataclasses.field(default_factory=dict)
    claimed: set[int] = dataclasses.field(default_factory=set)
    granted_slots: int = 0  # all pools (they share one slot size)
    pool_slots: dict[str, int] = dataclasses.field(default_factory=dict)

    def hold(self, grant: Grant) -> None:
        self.grants[grant.id] = grant
        self.granted_slots += grant.run.nslots
        self.pool_slots[grant.run.pool] = self.pool_slots.get(grant.run.pool, 0) + grant.run.nslots

    def let_go(self, grant: Grant) -> None:
        """``grant`` no longer counts against this session (returned, or the daemon's now)."""
        if self.grants.pop(grant.id, None) is not None:
            self.granted_slots -= grant.run.nslots
            self.pool_slots[grant.run.pool] -= grant.run.nslots

    def tell(self, event: SessionEvent) -> None:
        if self.sink is not None:
            self.sink(event)

    def refuse(self, code: ErrorCode, message: str) -> None:
        """Tell the session one of its notices was refused (the session stays open)."""
        log.warning("session %s: %s", self.id, message, extra={"session_id": self.id})
        self.tell(SessionError(code, message))


class Sessions:
    """The live sessions by id, with the session limit."""

    def __init__(self, max_sessions: int, clock: Callable[[], float]) -> None:
        self.max_sessions = max_sessions
        self.clock = clock
        self.by_id: dict[str, Session] = {}
        self._next = 1

    def __iter__(self) -> Iterator[Session]:
        return iter(self.by_id.values())

    def get(self, session_id: str) -> Session | None:
        return self.by_id.get(session_id)

    def open(
        self,
        *,
        pid: int,
        stages: Iterable[str],
        namespaces: dict[str, str] | None = None,
        gpu_uuids: Iterable[str] = (),
    ) -> Session:
        # A draining daemon still admits sessions: a reader that attaches now
        # can collect in-flight data; only new reservations are refused.
        live = sum(1 for s in self.by_id.values() if s.state is not SessionState.CLOSED)
        if live >= self.max_sessions:
            raise ResourceExhaustedError(f"session limit reached ({self.max_sessions})")
        sid = f"s{self._next}-{secrets.token_hex(4)}"
        self._next += 1
        session = Session(
            id=sid,
            token=secrets.token_bytes(16),
            pid=pid,
            stages=tuple(stages),
            created=self.clock(),
            namespaces=dict(namespaces or {}),
            gpu_uuids=tuple(gpu_uuids),
        )
        self.by_id[sid] = session
        return session

    def authenticate(self, session_id: str, token: bytes) -> Session:
        session = self.by_id.get(session_id)
        if session is None or not secrets.compare_digest(session.token, token):
            raise PermissionDeniedError("unknown session or wrong session token")
        if session.state is SessionState.CLOSED:
            raise SessionClosedError("session is closed")
        return session

    def bind(
        self, session_id: str, token: bytes, sink: Sink, *, pid: int, uid: int, gid: int
    ) -> Session:
        session = self.authenticate(session_id, token)
        if session.state is not SessionState.PENDING:
            raise PermissionDeniedError("session is already bound to a connection")
        session.state = SessionState.BOUND
        session.sink = sink
        session.pid, session.uid, session.gid = pid, uid, gid
        return session

    def close(self, session_id: str) -> Session | None:
        """Forget ``session_id``; the session closed now, or None if it was not open."""
        session = self.by_id.pop(session_id, None)
        if session is None or session.state is SessionState.CLOSED:
            return None
        session.state = SessionState.CLOSED
        session.sink = None
        return session

    def unbound_past(self, now: float, deadline: float) -> list[Session]:
        """Sessions opened more than ``deadline`` seconds ago and still not bound."""
        return [
            s
            for s in self.by_id.values()
            if s.state is SessionState.PENDING and now - s.created > deadline
        ]

    def tell_all(
        self,
        event: SessionEvent,
        *,
        skip: Session | None = None,
        stages: Collection[str] | None = None,
    ) -> None:
        """Tell every session (but ``skip``; with ``stages``, only those serving one)."""
        for s in self.by_id.values():
            if s is not skip and (stages is None or not set(stages).isdisjoint(s.stages)):
                s.tell(event)

    def stage_slots(self, stage: str, pool: str) -> int:
        """Slots of ``pool`` granted to the sessions serving ``stage``."""
        return sum(s.pool_slots.get(pool, 0) for s in self.by_id.values() if stage in s.stages)
