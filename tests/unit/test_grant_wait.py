"""The grant wait (``_grants.Grants``) with a fake grant source: no daemon.

What a put short of space does - ask once for every waiting put, give idle
grants back first, take freed space when it comes first, tell a refusal from
a timeout - is policy; these tests pin it with a source that answers as told.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Coroutine
from typing import Any

import pytest
from relayd_client._grants import IDLE_GRANTS, Grant, GrantCall, Grants, LeaseTable
from relayd_client.wire.errors import (
    DaemonUnavailableError,
    RelayError,
    ResourceExhaustedError,
)
from relayd_client.wire.rings import IdRing
from relayd_client.wire.shm import MAX_LEASE_SEQ

SLOT = 4096
DEFAULT_GRANT = 16 * SLOT  # the daemon's default grant: 16 slots


class FakeSource:
    """A daemon's Grant call as a queue of answers the test hands out."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, float, str]] = []
        self.returned: list[int] = []
        self.flushes = 0
        self.answers: asyncio.Queue[Grant | BaseException] = asyncio.Queue()
        self._next = 1

    def grant(self, nslots: int, base: int = 0, pool: str = "shm") -> Grant:
        gid, self._next = self._next, self._next + 1
        return Grant(gid, 0, base, nslots, gid << 32, pool)

    async def request_grant(self, min_bytes: int, timeout: float, pool: str) -> Grant:
        self.asked.append((min_bytes, timeout, pool))
        try:
            answer = await asyncio.wait_for(self.answers.get(), timeout)
        except TimeoutError:  # the daemon's answer when its queue did not move in time
            raise ResourceExhaustedError("grant wait timed out") from None
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def return_grant(self, grant_id: int) -> None:
        self.returned.append(grant_id)

    def flush(self) -> None:
        self.flushes += 1


class Closed:
    """check_open: raises once the session is gone."""

    def __init__(self) -> None:
        self.gone = False

    def __call__(self) -> None:
        if self.gone:
            raise DaemonUnavailableError("gone")


def _grants(source: FakeSource, check: Closed | None = None) -> Grants:
    g = Grants(LeaseTable(), source, check or Closed())
    g.configure(SLOT, DEFAULT_GRANT)
    return g


def _run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 10))


async def _settle() -> None:
    """Let every ready task run until all wait on something the test controls."""
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_held_grant_with_room_serves_without_asking() -> None:
    async def main() -> None:
        src = FakeSource()
        g = _grants(src)
        g.add(src.grant(8))
        lease = await g.reserve(3 * SLOT, time.monotonic() + 5)
        assert (lease.nslots, src.asked) == (3, [])
        assert g.cut(5 * SLOT) is not None and g.cut(SLOT) is None  # 3 + 5 of 8 slots

    _run(main())


def test_puts_short_of_space_share_one_grant_call() -> None:
    async def main() -> None:
        src = FakeSource()
        g = _grants(src)
        waiting = [asyncio.ensure_future(g.reserve(2 * SLOT, time.monotonic() + 5))
                   for _ in range(3)]  # fmt: skip
        await _settle()
        assert src.asked == [(2 * SLOT, pytest.approx(5, abs=0.5), "shm")]
        assert src.flushes == 1  # lingering notices went first: they may be the space
        src.answers.put_nowait(src.grant(6))
        leases = await asyncio.gather(*waiting)
        assert sorted(le.slot for le in leases) == [0, 2, 4]
        assert len(src.asked) == 1

    _run(main())


def test_idle_grants_go_back_before_asking_for_a_bigger_one() -> None:
    async def main() -> None:
        src = FakeSource()
        g = _grants(src)
        small = src.grant(2)
        g.add(small)
        task = asyncio.ensure_future(g.reserve(4 * SLOT, time.monotonic() + 5))
        await _settle()
        assert src.returned == [small.id] and small.id not in g.table.grants
        src.answers.put_nowait(src.grant(4))
        assert (await task).nslots == 4

    _run(main())


def test_space_freed_by_a_reader_ends_the_wait_before_the_grant() -> None:
    async def main() -> None:
        src = FakeSource()
        g = _grants(src)
        g.add(src.grant(4))
        held = g.cut(4 * SLOT)
        assert held is not None
        task = asyncio.ensure_future(g.reserve(4 * SLOT, time.monotonic() + 5))
        await _settle()
        assert len(src.asked) == 1 and not task.done()
        g.slots_back(held)  # the reader's Freed notice
        lease = await task
        assert lease.slot == held.slot
        src.answers.put_nowait(src.grant(4, base=4))  # the grant still lands, idle
        await _settle()
        assert len(g.table.grants) == 2

    _run(main())


def test_a_refusal_is_the_puts_error_at_once() -> None:
    async def main() -> None:
        src = FakeSource()
        g = _grants(src)
        task = asyncio.ensure_future(g.reserve(64 * SLOT, time.monotonic() + 5))
        await _settle()
        src.answers.put_nowait(ResourceExhaustedError("beyond the stage quota"))
        t0 = time.monotonic()
        with pytest.raises(ResourceExhaustedError, match="beyond the stage quota"):
            await task
        assert time.monotonic() - t0 < 4  # not at the deadline
        assert len(src.asked) == 1

    _run(main())


def test_a_call_that_timed_out_for_a_shorter_deadline_is_asked_again() -> None:
    async def main() -> None:
        src = FakeSource()
        g = _grants(src)
        short = asyncio.ensure_future(g.reserve(2 * SLOT, time.monotonic() + 0.3))
        await _settle()
        long = asyncio.ensure_future(g.reserve(2 * SLOT, time.monotonic() + 5))
        with pytest.raises(ResourceExhaustedError):
            await short  # its own deadline passed: the put fails
        await _settle()
        # The long put is not failed by the short one's timeout: it asked again.
        assert len(src.asked) == 2 and not long.done()
        src.answers.put_nowait(src.grant(2))
        assert (await long).nslots == 2

    _run(main())


def test_no_space_before_the_deadline_is_resource_exhausted() -> None:
    async def main() -> None:
        src = FakeSource()
        g = _grants(src)
        with pytest.raises(ResourceExhaustedError):
            await g.reserve(SLOT, time.monotonic() - 1)
        assert src.asked == []

    _run(main())


def test_a_lost_session_fails_the_wait_when_woken() -> None:
    async def main() -> None:
        src = FakeSource()
        check = Closed()
        g = _grants(src, check)
        task = asyncio.ensure_future(g.reserve(SLOT, time.monotonic() + 5))
        await _settle()
        check.gone = True
        g.space.set()  # what losing the session does
        with pytest.raises(DaemonUnavailableError):
            await task

    _run(main())


def test_a_run_granted_twice_is_refused() -> None:
    async def main() -> None:
        src = FakeSource()
        g = _grants(src)
        grant = src.grant(4)
        g.add(grant)
        src.answers.put_nowait(Grant(grant.id, 0, 4, 4, grant.gen_base, "shm"))
        g.add(Grant(99, 0, 8, 4, 99 << 32, "shm"))
        for _ in range(2):
            assert g.cut(4 * SLOT) is not None  # fill both grants
        with pytest.raises(RelayError, match="twice"):
            await g.reserve(4 * SLOT, time.monotonic() + 5)

    _run(main())


def test_idle_grants_are_kept_up_to_the_budget_then_given_back() -> None:
    async def main() -> None:
        src = FakeSource()
        g = _grants(src)
        per = DEFAULT_GRANT // SLOT
        grants = [src.grant(per, base=i * per) for i in range(IDLE_GRANTS + 1)]
        leases = []
        for grant in grants:
            g.add(grant)
            lease = g.cut(per * SLOT)
            assert lease is not None
            leases.append(lease)
        for lease in leases[:IDLE_GRANTS]:
            g.slots_back(lease)
        assert src.returned == []  # within the budget: kept for the next puts
        g.slots_back(leases[-1])
        assert src.returned == [grants[-1].id]
        g.return_idle()  # the daemon's RECLAIM event
        assert sorted(src.returned) == sorted(gr.id for gr in grants)
        assert not g.table.grants

    _run(main())


def test_a_spent_grant_goes_back_when_its_last_lease_does_and_a_new_one_is_asked() -> None:
    async def main() -> None:
        src = FakeSource()
        g = _grants(src)
        spent = src.grant(8)
        spent.next_seq = MAX_LEASE_SEQ
        g.add(spent)
        last = await g.reserve(SLOT, time.monotonic() + 5)
        assert last.grant is spent and spent.spent
        # Room for seven more slots, but no id to number them with: ask.
        task = asyncio.ensure_future(g.reserve(SLOT, time.monotonic() + 5))
        await _settle()
        assert len(src.asked) == 1 and src.returned == []  # its lease is still out
        src.answers.put_nowait(src.grant(8))
        assert (await task).grant is not spent
        g.slots_back(last)  # within the idle budget, yet of no more use
        assert src.returned == [spent.id] and spent.id not in g.table.grants

    _run(main())


def test_a_grant_larger_than_the_budget_is_kept_while_it_is_the_only_idle_one() -> None:
    """Defect: a writer of payloads larger than the idle budget gave its grant
    back at every read and paid a Grant call (~1 ms) at every put."""

    async def main() -> None:
        src = FakeSource()
        g = _grants(src)
        big = (IDLE_GRANTS + 2) * (DEFAULT_GRANT // SLOT)  # beyond the budget alone
        first = src.grant(big)
        g.add(first)
        for _ in range(3):  # put, read, put again: the same grant, no call
            lease = g.cut(big * SLOT)
            assert lease is not None and lease.grant is first
            g.slots_back(lease)
        assert src.returned == [] and src.asked == []
        # A second idle grant beyond the budget: one of them goes.
        second = src.grant(big, base=big)
        g.add(second)
        lease = g.cut(big * SLOT)
        assert lease is not None and g.cut(big * SLOT) is not None  # both in use
        g.slots_back(lease)
        assert src.returned == []  # one idle grant: kept
        other = next(iter(g.table.leases.values()))
        g.slots_back(other)
        assert len(src.returned) == 1 and len(g.table.grants) == 1
        g.return_idle()  # the daemon's RECLAIM event still takes it
        assert not g.table.grants

    _run(main())


def test_cancel_calls_ends_a_grant_call_in_flight() -> None:
    async def main() -> None:
        src = FakeSource()
        g = _grants(src)
        put = asyncio.ensure_future(g.reserve(SLOT, time.monotonic() + 5))
        await _settle()
        await g.cancel_calls()
        assert not g.calls
        with pytest.raises(asyncio.CancelledError):
            await put

    _run(main())


def _ring(g: Grants) -> IdRing:
    """Give ``g`` a Freed ring; returns the daemon's end."""
    daemon, fd = IdRing.create("relayd-freed")
    g.ring = IdRing.map(fd)
    os.close(fd)
    return daemon


def test_ring_ids_free_their_runs_at_the_next_cut_waking_nobody() -> None:
    async def main() -> None:
        src = FakeSource()
        g = _grants(src)
        wakes: list[None] = []
        g.wake = lambda: wakes.append(None)
        daemon = _ring(g)
        g.add(src.grant(4))

        async def answered() -> Grant:
            return src.grant(1)

        ended = asyncio.ensure_future(answered())
        await ended
        # The entry of a call whose put took freed space instead stays behind:
        # nobody waits on it, so it must not make the ring wake the loop.
        g.calls["shm"] = GrantCall(ended, 1, time.monotonic() + 5)
        a, b = g.cut(2 * SLOT), g.cut(2 * SLOT)
        assert a is not None and b is not None and g.cut(SLOT) is None
        assert daemon.push(b.id) and daemon.push(a.id)
        c = g.cut(2 * SLOT)
        # Both are aside now: the newest but one is reused (see Grants._cut).
        assert c is not None and c.slot == b.slot
        assert set(g.table.leases) == {c.id} and wakes == []
        daemon.push(a.id)  # a stale id: already free, nothing changes
        g.collect()
        assert set(g.table.leases) == {c.id}

    _run(main())


def test_an_empty_freed_ends_a_wait_whose_space_sits_in_the_ring() -> None:
    async def main() -> None:
        src = FakeSource()
        g = _grants(src)
        daemon = _ring(g)
        g.add(src.grant(4))
        held = g.cut(4 * SLOT)
        assert held is not None
        task = asyncio.ensure_future(g.reserve(4 * SLOT, time.monotonic() + 5))
        await _settle()
        assert daemon.push(held.id)  # written after the put looked
        await _settle()
        assert not task.done()  # nobody reads the ring while waiting...
        g.collect()  # ...until the daemon's nudge (an empty Freed) makes the client look
        assert (await task).slot == held.slot

    _run(main())
