"""The one thread that watches Mooncake batches in flight, on a stand-in engine.

The stand-in keeps Mooncake's rule that a batch is freed once
``transfer_check_status`` reported it terminal: asking again is a test failure,
as it would be undefined behaviour on the real engine.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from relayd.transports.base import TransferState
from relayd.transports.mooncake_engine import Watcher

TIMEOUT = 10.0


class Engine:
    """``transfer_check_status`` over statuses a test sets (0 pending, 1 done, -1 failed)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.status: dict[int, int] = {}
        self.freed: set[int] = set()
        self.misuse: list[str] = []
        self.checks = 0

    def transfer_check_status(self, batch_id: int) -> int:
        with self.lock:
            self.checks += 1
            if batch_id in self.freed:
                self.misuse.append(f"batch {batch_id} asked after it was freed")
                return -1
            rc = self.status[batch_id]
            if rc != 0:
                self.freed.add(batch_id)
            return rc

    def set(self, batch_id: int, rc: int) -> None:
        with self.lock:
            self.status[batch_id] = rc


def _watch(
    watcher: Watcher, ids: list[int], states: list[TransferState], start: int = 0
) -> asyncio.Future[None]:
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    watcher.watch(ids, states, start, lambda: done.set_result(None))
    return done


def test_an_idle_watcher_wakes_for_a_transfer_and_reports_it_on_the_loop() -> None:
    engine = Engine()

    async def main() -> None:
        watcher = Watcher(engine, asyncio.get_running_loop())
        try:
            for n in range(3):  # idle between transfers, woken by each
                engine.set(n, 0)
                states = [TransferState.PENDING]
                done = _watch(watcher, [n], states)
                engine.set(n, 1)
                await asyncio.wait_for(done, TIMEOUT)
                assert states == [TransferState.DONE]
        finally:
            await asyncio.to_thread(watcher.stop)

    asyncio.run(main())
    assert engine.misuse == []


def test_each_transfer_is_reported_when_all_its_ops_end_and_never_asked_again() -> None:
    engine = Engine()

    async def main() -> None:
        watcher = Watcher(engine, asyncio.get_running_loop())
        try:
            for b in (1, 2, 3):
                engine.set(b, 0)
            # ops [0, 1) were terminal before: the watcher starts at op 1
            first = [TransferState.DONE, TransferState.PENDING, TransferState.PENDING]
            second = [TransferState.PENDING]
            done_first = _watch(watcher, [0, 1, 2], first, start=1)
            done_second = _watch(watcher, [3], second)
            engine.set(3, -1)
            await asyncio.wait_for(done_second, TIMEOUT)
            assert second == [TransferState.FAILED]
            engine.set(1, 1)
            assert not done_first.done()
            engine.set(2, 1)
            await asyncio.wait_for(done_first, TIMEOUT)
            assert first == [TransferState.DONE] * 3
        finally:
            await asyncio.to_thread(watcher.stop)

    asyncio.run(main())
    assert engine.misuse == []


def test_an_unknown_status_fails_that_transfer_only() -> None:
    engine = Engine()

    async def main() -> None:
        watcher = Watcher(engine, asyncio.get_running_loop())
        try:
            engine.set(7, 0)
            engine.set(8, 0)
            odd = [TransferState.PENDING]
            fine = [TransferState.PENDING]
            done_odd = _watch(watcher, [7], odd)
            done_fine = _watch(watcher, [8], fine)
            engine.set(7, 42)
            await asyncio.wait_for(done_odd, TIMEOUT)
            assert odd == [TransferState.FAILED]
            engine.set(8, 1)
            await asyncio.wait_for(done_fine, TIMEOUT)
            assert fine == [TransferState.DONE]
        finally:
            await asyncio.to_thread(watcher.stop)

    asyncio.run(main())


@pytest.mark.parametrize("in_flight", [False, True])
def test_stop_returns_and_nothing_is_asked_after_it(in_flight: bool) -> None:
    engine = Engine()

    async def main() -> None:
        watcher = Watcher(engine, asyncio.get_running_loop())
        if in_flight:
            engine.set(5, 0)  # never ends: stop() must not wait for it
            watcher.watch([5], [TransferState.PENDING], 0, lambda: None)
        await asyncio.wait_for(asyncio.to_thread(watcher.stop), TIMEOUT)
        with engine.lock:
            asked = engine.checks
        # stop() joined the thread: nothing can have asked since
        await asyncio.sleep(0)
        with engine.lock:
            assert engine.checks == asked

    asyncio.run(main())
