"""Two small parts on their own: parked early notices, and the session table."""

from __future__ import annotations

import pytest
from relayd_client import PermissionDeniedError, ResourceExhaustedError, SessionClosedError

from relayd.pools import early as early_mod
from relayd.pools.early import Early, EarlyKind, EarlyNotices
from relayd.pools.events import Reclaim, SessionEvent
from relayd.pools.sessions import Sessions, SessionState


def _early(sid: str, at: float = 0.0) -> Early:
    return Early(EarlyKind.RELEASE, sid, 7, at, ("talker",))


def test_early_notices_are_bounded_per_lease_and_in_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(early_mod, "MAX_EARLY", 10)
    e = EarlyNotices()
    for i in range(early_mod.MAX_EARLY_PER_LEASE):
        assert e.park(1, _early(f"s{i % 2}"))
    assert not e.park(1, _early("s9"))  # the lease's share is full
    assert e.from_session(1, "s0") == early_mod.MAX_EARLY_PER_LEASE // 2
    assert e.park(2, _early("s0")) and e.park(2, _early("s0"))
    assert not e.park(3, _early("s0"))  # 10 in all
    assert not e.park(3, _early("s0"))  # and a refused lease leaves no empty list
    assert [x.session_id for x in e.pop(2)] == ["s0", "s0"]
    assert e.park(3, _early("s0"))  # popping made room
    assert e.pop(99) == []


def test_early_notices_expire_by_their_first_arrival() -> None:
    e = EarlyNotices()
    e.park(1, _early("a", at=0.0))
    e.park(1, _early("b", at=9.0))
    e.park(2, _early("c", at=5.0))
    e.expire(early_mod.EARLY_DEADLINE + 1.0)
    assert e.pop(1) == [] and [x.session_id for x in e.pop(2)] == ["c"]
    assert not e


def test_sessions_bind_once_with_the_right_token_and_close_once() -> None:
    t = Sessions(2, lambda: 0.0)
    s = t.open(pid=1, stages=["a"])
    t.open(pid=2, stages=["b"])
    with pytest.raises(ResourceExhaustedError, match="session limit"):
        t.open(pid=3, stages=["c"])
    with pytest.raises(PermissionDeniedError):
        t.authenticate(s.id, b"\0" * 16)
    heard: list[SessionEvent] = []
    assert t.bind(s.id, s.token, heard.append, pid=5, uid=6, gid=7) is s
    assert (s.state, s.pid, s.uid, s.gid) == (SessionState.BOUND, 5, 6, 7)
    with pytest.raises(PermissionDeniedError, match="already bound"):
        t.bind(s.id, s.token, heard.append, pid=5, uid=6, gid=7)
    t.tell_all(Reclaim(), stages={"b"})
    assert heard == []  # only sessions serving a named stage hear it
    t.tell_all(Reclaim())
    assert heard == [Reclaim()]
    assert t.close(s.id) is s and s.state is SessionState.CLOSED
    assert t.close(s.id) is None
    with pytest.raises(PermissionDeniedError):
        t.authenticate(s.id, s.token)  # gone from the table
    s.tell(Reclaim())
    assert heard == [Reclaim()]  # a closed session hears nothing more


def test_unbound_sessions_past_the_deadline() -> None:
    now = [0.0]
    t = Sessions(8, lambda: now[0])
    old = t.open(pid=1, stages=["a"])
    now[0] = 5.0
    young = t.open(pid=1, stages=["a"])
    bound = t.open(pid=1, stages=["a"])
    t.bind(bound.id, bound.token, lambda ev: None, pid=1, uid=0, gid=0)
    now[0] = 10.5
    assert t.unbound_past(now[0], 10.0) == [old]
    assert young.state is SessionState.PENDING
    young.state = SessionState.CLOSED  # closed, not yet forgotten
    with pytest.raises(SessionClosedError):
        t.authenticate(young.id, young.token)
