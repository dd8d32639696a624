"""Freed batching on its own: what lingers, what goes at once, one notice per writer."""

from __future__ import annotations

import asyncio
import os

import pytest
from relayd_client.wire.rings import RING_SLOTS, IdRing

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


def _ringed(space_short: list[bool]) -> tuple[FreedBatcher, list[tuple[str, Freed]], IdRing]:
    sent: list[tuple[str, Freed]] = []
    b = FreedBatcher(60.0, lambda sid, ev: sent.append((sid, ev)), lambda: space_short[0])
    ring, fd = IdRing.create("relayd-freed")
    writer = IdRing.map(fd)
    os.close(fd)
    b.attach_ring("w", ring)
    return b, sent, writer


def test_a_session_with_a_ring_hears_of_arena_leases_there_and_nothing_is_sent() -> None:
    async def scenario() -> None:
        short = [False]
        b, sent, writer = _ringed(short)
        b.add("w", 1, 4 << 20)  # over the byte cap: would go at once as a frame
        b.add("w", 2, 64 * KIB)
        b.flush(space_short=False)
        assert sent == [] and writer.take() == [1, 2]
        assert not b.pending("w")
        b.add("w", 3, 64 * KIB, arena=False)  # a GPU pool's lease: frames only
        short[0] = True
        b.add("w", 4, 64 * KIB)  # a grant waits: a blocked writer reads no ring
        b.flush(space_short=True)
        assert sent == [("w", Freed((3, 4)))] and writer.take() == []
        writer.close()
        b.drop("w")

    asyncio.run(scenario())


def test_a_grant_request_nudges_a_writer_whose_ring_holds_unread_ids() -> None:
    async def scenario() -> None:
        b, sent, writer = _ringed([False])
        b.add("w", 1, 64 * KIB)
        assert b.pending("w")  # unread in the ring
        b.send(["w"])  # what GrantQueue.grant does for a pending writer
        assert sent == [("w", Freed(()))]
        assert writer.take() == [1]
        b.send(["w"])
        assert len(sent) == 1 and not b.pending("w")
        writer.close()
        b.drop("w")

    asyncio.run(scenario())


def test_a_full_ring_leaves_the_rest_to_frames() -> None:
    async def scenario() -> None:
        b, sent, writer = _ringed([False])
        for lease_id in range(1, RING_SLOTS + 3):
            b.add("w", lease_id, 1 << 20)
        b.flush(space_short=False)
        assert sent == [("w", Freed((RING_SLOTS + 1, RING_SLOTS + 2)))]
        assert writer.take() == list(range(1, RING_SLOTS + 1))
        writer.close()
        b.drop("w")
        b.add("w", 99, 64 * KIB)  # a closed session's ring is gone: pending as before
        assert b.pending("w")

    asyncio.run(scenario())
