"""CreditPool: the bound, FIFO order, and that every route out gives the credit back.

Synchronisation is by events and futures only; ``_settle`` waits for a condition
with a deadline instead of sleeping.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from relayd_client.wire.errors import InvalidArgumentError, ResourceExhaustedError

from relayd.transports.credits import CreditPool, PeerCredits

PEER = "10.0.0.2:15001"


async def _settle(condition: Callable[[], bool], what: str, limit: float = 5.0) -> None:
    """Let the loop run until ``condition`` holds; fail after ``limit`` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while not condition():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0)


def _counts(pool: CreditPool, *, waiting: int = -1, arrived: int = -1) -> Callable[[], bool]:
    """A condition on the pool's counters (-1: don't care)."""

    def check() -> bool:
        queued = pool.waiting(PEER)
        return waiting in (-1, queued) and arrived in (-1, queued + pool.in_use(PEER))

    return check


@dataclasses.dataclass
class _Holder:
    """A task that takes a credit, records it, and holds it until told to let go."""

    pool: CreditPool
    peer: str = PEER
    timeout: float = 30.0
    got: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    let_go: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    def start(self, in_flight: list[int] | None = None, peak: list[int] | None = None) -> _Holder:
        async def run() -> None:
            async with self.pool.acquire(self.peer, self.timeout):
                if in_flight is not None and peak is not None:
                    in_flight[0] += 1
                    peak[0] = max(peak[0], in_flight[0])
                self.got.set()
                try:
                    await self.let_go.wait()
                finally:
                    if in_flight is not None:
                        in_flight[0] -= 1

        self.task = asyncio.get_running_loop().create_task(run())
        return self


def _run(coro_fn: Callable[[], object]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 30))  # type: ignore[arg-type]


def test_grants_up_to_capacity_then_queues() -> None:
    async def main() -> None:
        pool = CreditPool(2)
        holders = [_Holder(pool).start() for _ in range(3)]
        await holders[0].got.wait()
        await holders[1].got.wait()
        await _settle(lambda: pool.waiting(PEER) == 1, "the third to queue")
        assert not holders[2].got.is_set()
        assert pool.in_use(PEER) == 2 and pool.capacity(PEER) == 2
        holders[0].let_go.set()
        await holders[2].got.wait()
        assert pool.in_use(PEER) == 2
        for h in holders:
            h.let_go.set()
        await asyncio.gather(*(h.task for h in holders if h.task))
        assert pool.in_use(PEER) == 0
        assert pool.stats() == {PEER: PeerCredits(capacity=2, in_use=0, waiting=0)}

    _run(main)


def test_fifo_order_and_no_barging() -> None:
    async def main() -> None:
        pool = CreditPool(1)
        current = _Holder(pool).start()
        await current.got.wait()
        waiters = []
        for i in range(5):
            waiters.append(_Holder(pool).start())
            await _settle(_counts(pool, waiting=i + 1), f"waiter {i} to queue")
        for i, nxt in enumerate(waiters):
            current.let_go.set()
            await nxt.got.wait()
            assert [w.got.is_set() for w in waiters[i + 1 :]] == [False] * (4 - i)
            # A newcomer finds no free credit: the released one went to the queue.
            with pytest.raises(ResourceExhaustedError):
                async with pool.acquire(PEER, timeout=0):
                    pass
            current = nxt
        current.let_go.set()
        await asyncio.gather(*(w.task for w in waiters if w.task))
        assert pool.in_use(PEER) == 0

    _run(main)


def test_timeout_raises_resource_exhausted_and_leaves_queue_clean() -> None:
    async def main() -> None:
        pool = CreditPool(1)
        holder = _Holder(pool).start()
        await holder.got.wait()
        with pytest.raises(ResourceExhaustedError, match="no credit for peer"):
            async with pool.acquire(PEER, timeout=0.01):
                pytest.fail("must not get a credit")
        assert pool.waiting(PEER) == 0
        with pytest.raises(ResourceExhaustedError):
            async with pool.acquire(PEER, timeout=0):
                pytest.fail("must not get a credit")
        holder.let_go.set()
        await holder.task  # type: ignore[misc]
        assert pool.in_use(PEER) == 0
        async with pool.acquire(PEER, timeout=0):
            assert pool.in_use(PEER) == 1

    _run(main)


def test_exception_in_body_returns_credit() -> None:
    async def main() -> None:
        pool = CreditPool(1)
        with pytest.raises(RuntimeError):
            async with pool.acquire(PEER, timeout=1):
                raise RuntimeError("boom")
        assert pool.in_use(PEER) == 0

    _run(main)


def test_cancel_while_waiting_keeps_queue_moving() -> None:
    async def main() -> None:
        pool = CreditPool(1)
        holder = _Holder(pool).start()
        await holder.got.wait()
        doomed = _Holder(pool).start()
        behind = _Holder(pool).start()
        await _settle(lambda: pool.waiting(PEER) == 2, "two waiters")
        assert doomed.task is not None
        doomed.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed.task
        assert pool.waiting(PEER) == 1
        holder.let_go.set()
        await behind.got.wait()
        behind.let_go.set()
        await asyncio.gather(holder.task, behind.task)  # type: ignore[arg-type]
        assert pool.in_use(PEER) == 0

    _run(main)


def test_cancel_between_grant_and_resume_passes_credit_on() -> None:
    async def main() -> None:
        pool = CreditPool(1)
        async with pool.acquire(PEER, timeout=1):
            granted = _Holder(pool).start()
            behind = _Holder(pool).start()
            await _settle(lambda: pool.waiting(PEER) == 2, "two waiters")
        # Leaving the block handed the credit to `granted`'s future without yielding;
        # `granted` is cancelled before it can resume.
        assert granted.task is not None
        granted.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await granted.task
        assert not granted.got.is_set()
        await behind.got.wait()
        assert pool.in_use(PEER) == 1
        behind.let_go.set()
        await behind.task  # type: ignore[misc]
        assert pool.in_use(PEER) == 0

    _run(main)


def test_cancelled_waiter_not_yet_cleaned_up_blocks_nobody() -> None:
    async def main() -> None:
        pool = CreditPool(1)
        async with pool.acquire(PEER, timeout=1):
            doomed = _Holder(pool).start()
            await _settle(lambda: pool.waiting(PEER) == 1, "the waiter")
            assert doomed.task is not None
            # Cancelling cancels its waiter future now; its cleanup runs later.
            doomed.task.cancel()
        # No yield since the cancel: the stale entry is still queued.
        async with pool.acquire(PEER, timeout=0):
            assert pool.in_use(PEER) == 1
        with pytest.raises(asyncio.CancelledError):
            await doomed.task
        assert pool.in_use(PEER) == 0 and pool.waiting(PEER) == 0

    _run(main)


def test_cancel_while_holding_returns_credit() -> None:
    async def main() -> None:
        pool = CreditPool(1)
        holder = _Holder(pool).start()
        await holder.got.wait()
        assert holder.task is not None
        holder.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await holder.task
        assert pool.in_use(PEER) == 0

    _run(main)


def test_release_when_keeps_credit_until_future_done() -> None:
    async def main() -> None:
        pool = CreditPool(1)
        settled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        async with pool.acquire(PEER, timeout=1) as credit:
            credit.release_when(settled)
        assert pool.in_use(PEER) == 1 and not credit.released
        settled.set_result(None)
        await _settle(lambda: credit.released, "the callback")
        assert pool.in_use(PEER) == 0
        credit.release()  # idempotent
        assert pool.in_use(PEER) == 0

    _run(main)


def test_peers_are_independent_and_capacity_per_peer() -> None:
    async def main() -> None:
        pool = CreditPool(1, per_peer={"b": 3})
        async with (
            pool.acquire("a", timeout=0),
            pool.acquire("b", 0),
            pool.acquire("b", 0),
            pool.acquire("b", 0),
        ):
            assert (pool.in_use("a"), pool.in_use("b")) == (1, 3)
            assert pool.capacity("b") == 3
            with pytest.raises(ResourceExhaustedError):
                async with pool.acquire("b", timeout=0):
                    pass
        assert pool.stats()["b"] == PeerCredits(capacity=3, in_use=0, waiting=0)

    _run(main)


def test_rejects_non_positive_capacity() -> None:
    with pytest.raises(InvalidArgumentError):
        CreditPool(0)
    with pytest.raises(InvalidArgumentError):
        CreditPool(1, per_peer={"x": 0})


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 5),
    tasks=st.integers(1, 30),
    steps=st.lists(st.tuples(st.sampled_from(["release", "cancel"]), st.integers(0, 1000))),
)
def test_property_bound_fifo_and_cancellation(
    capacity: int, tasks: int, steps: list[tuple[str, int]]
) -> None:
    """Against a FIFO model: holders are always the first `capacity` live tasks in
    arrival order, in-flight never exceeds capacity, and cancelling holders or
    waiters never loses or leaks a credit."""

    async def main() -> None:
        pool = CreditPool(capacity)
        in_flight, peak = [0], [0]
        holders = []
        for i in range(tasks):
            holders.append(_Holder(pool).start(in_flight, peak))
            # Arrival order is the order the tasks reach the pool.
            await _settle(_counts(pool, arrived=i + 1), f"task {i} to arrive")
        live = list(range(tasks))  # model: FIFO of tasks still running

        async def check() -> None:
            expected = live[:capacity]
            for i in expected:
                await holders[i].got.wait()
            got = {i for i in live if holders[i].got.is_set()}
            assert got == set(expected)
            assert pool.in_use(PEER) == len(expected) <= capacity
            assert pool.waiting(PEER) == len(live) - len(expected)

        await check()
        for action, pick in steps:
            if not live:
                break
            if action == "release":
                victim = live[pick % min(capacity, len(live))]
                holders[victim].let_go.set()
                await holders[victim].task  # type: ignore[misc]
            else:
                victim = live[pick % len(live)]
                task = holders[victim].task
                assert task is not None
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            live.remove(victim)
            await check()
        for i in live:
            holders[i].let_go.set()
            await holders[i].task  # type: ignore[misc]
        assert peak[0] <= capacity
        assert in_flight[0] == 0
        assert pool.in_use(PEER) == 0 and pool.waiting(PEER) == 0

    _run(main)
