"""Release rings on their own: each id judged as its session's Release, one ring's
trouble kept to that ring, and a timer that backs off while the rings stay empty."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Iterator

import pytest
from relayd_client.wire.errors import InvalidArgumentError
from relayd_client.wire.rings import CLAIM_BIT, RING_SLOTS, IdRing

from relayd.pools import released
from relayd.pools.events import SessionError, SessionEvent
from relayd.pools.released import ReleaseRings
from relayd.pools.sessions import Session, Sessions

LINGER = 0.01


class _Judge:
    """Records every Release judged; raises for the ids it is told to."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int]] = []
        self.refuse: set[int] = set()
        self.crash: set[int] = set()

    def __call__(self, session: Session, lease_id: int, generation: int) -> None:
        self.seen.append((session.id, lease_id, generation))
        if lease_id in self.refuse:
            raise InvalidArgumentError(f"lease {lease_id} breaks a rule")
        if lease_id in self.crash:
            raise RuntimeError("a bug")


@dataclasses.dataclass
class World:
    rings: ReleaseRings
    judge: _Judge
    claims: _Judge  # the Claims judged
    client: dict[str, IdRing]  # each stage's end of its Release ring
    ids: dict[str, str]  # each stage's session id
    told: dict[str, list[SessionEvent]]  # what each session was told


@pytest.fixture
def world() -> Iterator[World]:
    sessions = Sessions(8, time.monotonic)
    judge, claims = _Judge(), _Judge()
    rings = ReleaseRings(
        sessions, judge, claims, outstanding=lambda: True, after=lambda: None, linger=LINGER
    )
    w = World(rings, judge, claims, {}, {}, {})
    fds = []
    for stage in ("a", "b"):
        s = sessions.open(pid=os.getpid(), stages=[stage])
        w.told[stage] = []
        sessions.bind(s.id, s.token, w.told[stage].append, pid=1, uid=0, gid=0)
        daemon_side, fd = IdRing.create("relayd-release")
        fds.append(fd)
        rings.attach(s.id, daemon_side)
        w.client[stage] = IdRing.map(fd)
        w.ids[stage] = s.id
    yield w
    rings.close()
    for fd in fds:
        os.close(fd)
    for ring in w.client.values():
        ring.close()


def test_each_id_is_judged_as_its_own_sessions_release_in_order(world: World) -> None:
    for lease_id in (5, 6, 7):
        assert world.client["a"].push(lease_id)
    assert world.client["b"].push(9)
    assert world.rings.take_all() == 4
    a, b = world.ids["a"], world.ids["b"]
    assert world.judge.seen == [(a, 5, 5), (a, 6, 6), (a, 7, 7), (b, 9, 9)]
    assert world.rings.take_all() == 0 and world.rings.by_ring == 4


def test_a_word_with_the_claim_bit_is_judged_as_a_claim_in_its_place(world: World) -> None:
    ring = world.client["a"]
    assert ring.push(4) and ring.push(5 | CLAIM_BIT) and ring.push(5)
    order: list[str] = []
    world.judge.seen, world.claims.seen = _Logged(order, "release"), _Logged(order, "claim")
    assert world.rings.take_all() == 3
    a = world.ids["a"]
    assert order == ["release", "claim", "release"]
    assert list(world.claims.seen) == [(a, 5, 5)]
    assert list(world.judge.seen) == [(a, 4, 4), (a, 5, 5)]
    assert world.rings.by_ring == 2  # releases only


class _Logged(list[tuple[str, int, int]]):
    """A judge's record that also notes, in one shared list, which judge saw each id."""

    def __init__(self, order: list[str], kind: str) -> None:
        super().__init__()
        self.order, self.kind = order, kind

    def append(self, item: tuple[str, int, int]) -> None:
        self.order.append(self.kind)
        super().append(item)


def test_a_full_ring_is_taken_in_one_turn_of_at_most_its_slots(world: World) -> None:
    for lease_id in range(1, RING_SLOTS + 1):
        assert world.client["a"].push(lease_id)
    assert world.rings.take("x") == 0  # no such session
    assert world.rings.take(world.ids["a"]) == RING_SLOTS
    assert [lid for _, lid, _ in world.judge.seen] == list(range(1, RING_SLOTS + 1))


def test_a_rule_broken_ends_that_sessions_ring_only(world: World) -> None:
    world.judge.refuse.add(6)
    for lease_id in (5, 6, 7):
        assert world.client["a"].push(lease_id)
    assert world.client["b"].push(9)
    world.rings.take_all()
    # a's ring ends at the bad id (7 is never judged), a is told why; b is untouched.
    assert [lid for _, lid, _ in world.judge.seen] == [5, 6, 9]
    assert [type(e) for e in world.told["a"]] == [SessionError] and world.told["b"] == []
    assert world.client["a"].push(8) and world.rings.take_all() == 0  # a's ring is not read
    assert world.client["b"].push(10) and world.rings.take_all() == 1


def test_a_bug_on_one_ring_never_reaches_the_caller(world: World) -> None:
    world.judge.crash.add(5)
    assert world.client["a"].push(5) and world.client["b"].push(9)
    world.rings.take_all()  # does not raise
    assert [lid for _, lid, _ in world.judge.seen] == [5, 9]


def test_the_timer_backs_off_while_the_rings_stay_empty_and_keeps_up_when_they_fill(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(released, "IDLE_TICK_S", 8 * LINGER)
    rings = world.rings

    async def scenario() -> list[float]:
        intervals = []
        for _ in range(4):  # empty ticks: twice the linger, 4x, 8x, then capped at 8x
            rings._tick()
            intervals.append(rings._interval)
        assert world.client["a"].push(3)
        rings._tick()
        intervals.append(rings._interval)
        rings.close()
        return intervals

    got = asyncio.run(scenario())
    assert got == [4 * LINGER, 8 * LINGER, 8 * LINGER, 8 * LINGER, 2 * LINGER]
    assert [lid for _, lid, _ in world.judge.seen] == [3]


def test_a_turn_that_read_every_ring_puts_off_a_timer_about_to_fire(world: World) -> None:
    rings = world.rings
    rings._interval = 10.0  # seconds: nothing here waits for it

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        rings.schedule()
        fresh = rings._timer
        assert fresh is not None
        rings.schedule()  # a timed read, or a grant's: the armed timer stands
        rings.schedule(restart=True)  # a frame's read: a timer due in 10 s stands too
        assert rings._timer is fresh and not fresh.cancelled()
        fresh.cancel()
        due = rings._timer = loop.call_later(0.001, rings._tick)  # due within half its wait
        floor = loop.time() + rings._interval
        rings.schedule(restart=True)
        assert due.cancelled()
        assert rings._timer is not None and rings._timer.when() >= floor
        rings.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("left", [0.2, 0.9, 1.1, 1.9], ids=lambda f: f"due-in-{f}-lingers")
def test_after_a_frames_turn_the_timer_waits_longer_than_a_writers_linger(
    world: World, left: float
) -> None:
    """A busy writer's frames come a linger and a put apart: a timer due within
    one linger of a frame's turn comes before the next frame, a daemon wake-up
    of its own each time, with nothing in the rings that frame would not take."""
    rings = world.rings

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        rings._timer = loop.call_later(left * LINGER, rings._tick)  # armed before this frame
        rings.schedule(restart=True)  # the frame's turn read every ring
        assert rings._timer is not None
        assert rings._timer.when() - loop.time() > LINGER
        rings.close()

    asyncio.run(scenario())
