"""The Mooncake transport's in-flight rule for a pull with ``then`` ops, on a
stand-in engine: what its error says about the ``then`` ranges when it ends
before they were submitted.

The stand-in records every submit and keeps each op pending until the test ends
it; a submit to a gated remote address waits until the test opens the gate, as
a first contact's handshake does.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable

import pytest

from relayd.config import Settings
from relayd.transports import mooncake as mc
from relayd.transports.base import MemoryRegion, PullFailedError, PullOp, PullTimeoutError

BOUND = 10.0  # every wait below; a hang check, not a performance assertion
PULL_TIMEOUT = 2.0  # the pull under test; everything before it takes milliseconds
PEER = "10.0.0.2:15001"
LOCAL = MemoryRegion("arena", 1 << 20, 1 << 20)
# Remote addresses, each naming what the stand-in does with a submit to it.
WARM, REFUSED, BODY, CHECK, OTHER = 0x1000, 0x2000, 0x3000, 0x4000, 0x5000


class Engine:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.status: dict[int, int] = {}
        self.batch_of: dict[int, int] = {}  # remote address -> batch id
        self.submitted: list[int] = []  # remote addresses, in submit order
        self.done_at_once = {WARM}
        # remote address -> (a submit is waiting here, let it go on)
        self.gates: dict[int, tuple[threading.Event, threading.Event]] = {}

    def gate(self, remote: int) -> tuple[threading.Event, threading.Event]:
        self.gates[remote] = (threading.Event(), threading.Event())
        return self.gates[remote]

    def batch_transfer_async_read(
        self, peer: str, local: list[int], remote: list[int], length: list[int]
    ) -> int:
        gate = self.gates.get(remote[0])
        if gate is not None:
            gate[0].set()
            assert gate[1].wait(BOUND)
        with self.lock:
            self.submitted.append(remote[0])
            if remote[0] == REFUSED:
                return 0
            batch = next(self.ids)
            self.status[batch] = 1 if remote[0] in self.done_at_once else 0
            self.batch_of[remote[0]] = batch
            return batch

    def finish(self, remote: int) -> None:
        """The op to ``remote`` ends DONE (at once, if it is not submitted yet)."""
        with self.lock:
            self.done_at_once.add(remote)
            if remote in self.batch_of:
                self.status[self.batch_of[remote]] = 1

    def transfer_check_status(self, batch: int) -> int:
        with self.lock:
            return self.status[batch]

    def unregister_memory(self, base: int) -> int:
        return 0

    def register_memory(self, base: int, length: int) -> int:
        return 0


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0)


def _op(offset: int, remote: int) -> list[PullOp]:
    return [PullOp(LOCAL.base + offset, remote, 4096)]


@pytest.mark.parametrize("where", ["waiting for first contact", "being submitted"])
def test_a_pull_that_times_out_between_its_phases_never_writes_after_saying_it_cannot(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The body landed; the ``then`` op (the generation check after it) has not been
    handed to Mooncake yet because the peer must be reached anew. The pull times out
    there. Said not in flight, the ``then`` op must never be submitted afterwards (its
    local run is reused at once); if its submit had begun, it is in flight."""
    engine = Engine()
    monkeypatch.setattr(mc, "open_engine", lambda *args: (engine, 15000))

    async def main() -> None:
        transport = mc.MooncakeTransport(Settings(peer_address="127.0.0.1:0", peer_timeout=2.0))
        await transport.start()
        try:
            await transport.register(LOCAL)
            await asyncio.wait_for(transport.pull(PEER, _op(0, WARM), timeout=BOUND), BOUND)
            loop = asyncio.get_running_loop()
            pull = loop.create_task(
                transport.pull(PEER, _op(0, BODY), then=_op(8192, CHECK), timeout=PULL_TIMEOUT)
            )
            await asyncio.wait_for(_until(lambda: BODY in engine.batch_of), BOUND)
            # Another pull's submit fails: the next one to this peer reaches it anew.
            with pytest.raises(PullFailedError):
                await asyncio.wait_for(
                    transport.pull(PEER, _op(4096, REFUSED), timeout=BOUND), BOUND
                )
            if where == "waiting for first contact":
                # A third pull holds the first contact: the check op waits behind it.
                entered, go = engine.gate(OTHER)
                other = loop.create_task(transport.pull(PEER, _op(12288, OTHER), timeout=BOUND))
                assert await asyncio.to_thread(entered.wait, BOUND)
                engine.finish(BODY)
            else:
                # The check op's submit is under way on a worker when the pull ends.
                entered, go = engine.gate(CHECK)
                engine.finish(BODY)
                assert await asyncio.to_thread(entered.wait, BOUND)
            with pytest.raises(PullTimeoutError) as timed_out:
                await asyncio.wait_for(pull, BOUND)
            err = timed_out.value
            if where == "waiting for first contact":
                assert err.in_flight is False
                engine.finish(OTHER)
                engine.finish(CHECK)  # were it submitted after all, it would end
                go.set()
                await asyncio.wait_for(other, BOUND)
                await asyncio.wait_for(transport.wait_settled(_op(8192, CHECK)), BOUND)
                assert engine.submitted == [WARM, BODY, REFUSED, OTHER]
            else:
                assert err.in_flight is True
                assert not err.settled.done()
                engine.finish(CHECK)
                go.set()
                await asyncio.wait_for(err.settled, BOUND)
                assert engine.submitted == [WARM, BODY, REFUSED, CHECK]
        finally:
            for _, go in engine.gates.values():
                go.set()
            await asyncio.wait_for(transport.close(), BOUND)

    asyncio.run(main())
