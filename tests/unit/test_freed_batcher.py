"""Freed batching on its own: what lingers, what goes at once, one notice per writer."""

from __future__ import annotations

import asyncio

import pytest

from relayd.pools import freed
from relayd.pools.events import Freed
from relayd.pools.freed import FreedBatcher

KIB = 1 << 10


def _batcher(linger: float) -> tuple[FreedBatcher, list[tuple[str, Freed]]]:
    sent: list[tuple[str, Freed]] = []
    return FreedBatcher(linger, lambda sid, ev: sent.append((sid, ev))), sent


def test_without_a_linger_each_turn_sends_one_notice_per_writer_in_order() -> None:
    b, sent = _batcher(0.0)
    for sid, lease_id in [("w1", 3), ("w2", 9), ("w1", 4)]:
        b.add(sid, lease_id, 64 * KIB)
    b.flush(space_short=False)
    assert sent == [("w1", Freed((3, 4))), ("w2", Freed((9,)))]
    b.flush(space_short=False)
    assert len(sent) == 2  # nothing twice


def test_notices_linger_until_the_timer_and_then_go_together() -> None:
    async def scenario() -> list[tuple[str, Freed]]:
        b, sent = _batcher(0.01)
        b.add("w", 1, KIB)
        b.flush(space_short=False)
        b.add("w", 2, KIB)
        b.flush(space_short=False)
        assert sent == []
        async with asyncio.timeout(5):
            while not sent:
                await asyncio.sleep(0.005)
        return sent

    assert asyncio.run(scenario()) == [("w", Freed((1, 2)))]


def test_a_writer_owed_the_byte_cap_is_told_at_once_others_keep_lingering(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(freed, "FREED_LINGER_MAX_BYTES", 128 * KIB)

    async def scenario() -> None:
        b, sent = _batcher(60.0)
        b.add("small", 1, 64 * KIB)
        b.add("big", 2, 64 * KIB)
        b.flush(space_short=False)
        assert sent == []
        b.add("big", 3, 64 * KIB)  # big reaches the cap
        b.flush(space_short=False)
        assert sent == [("big", Freed((2, 3)))]
        assert b.pending("small") and not b.pending("big")
        b.flush(space_short=True)  # a grant waits for space: nothing lingers
        assert sent[-1] == ("small", Freed((1,)))

    asyncio.run(scenario())


def test_a_writer_owed_2_mib_is_told_at_once() -> None:
    """Unlike a client's notices, a big Freed does not wait for company: the daemon
    sends it in a turn it is awake for anyway, and the writer needs the space."""

    async def scenario() -> None:
        b, sent = _batcher(60.0)
        b.add("w", 1, 1 << 20)
        b.flush(space_short=False)
        assert sent == []
        b.add("w", 2, 1 << 20)
        b.flush(space_short=False)
        assert sent == [("w", Freed((1, 2)))]

    asyncio.run(scenario())


def test_a_grant_request_takes_its_own_notices_and_a_closed_writer_gets_none() -> None:
    async def scenario() -> None:
        b, sent = _batcher(60.0)
        for sid, lease_id in [("asker", 1), ("other", 2), ("gone", 3)]:
            b.add(sid, lease_id, KIB)
        b.flush(space_short=False)
        b.send(["asker"])
        assert sent == [("asker", Freed((1,)))]
        b.drop("gone")
        b.send()  # everything pending, and the linger's timer is cancelled
        assert sent == [("asker", Freed((1,))), ("other", Freed((2,)))]

    asyncio.run(scenario())
