"""A push grant given to a peer taken for lost stays out of use a while."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from relayd_client.wire.slots import SlotAllocator

from relayd.pools.arena import Run
from relayd.push import PushManager
from relayd.push_landing import QUARANTINE_TIMEOUTS, GrantIn


def test_a_lost_peers_grant_goes_back_only_after_its_writes_surely_ended() -> None:
    freed: list[Run] = []
    back = asyncio.Event()

    def free(run: Run) -> None:
        freed.append(run)
        back.set()

    settings = SimpleNamespace(peer_timeout=0.01, push_grant_size=1 << 20)
    parts: Any = SimpleNamespace(
        arena=SimpleNamespace(free=free),
        leases=SimpleNamespace(wake=lambda: None),
        settings=settings,
    )
    push = PushManager(parts)
    used = SlotAllocator(8)
    assert used.allocate(3) == 0  # a landed lease still holds slots 0-2
    push.landing.given["node-a"] = GrantIn("node-a", "e1", 1, Run(0, 16, 8, "shm"), used)

    async def scenario() -> None:
        push.peer_down(SimpleNamespace(node_id="node-a", address="10.0.0.5:9092"))  # type: ignore[arg-type]
        # A write of the lost peer may still land in the grant's free part.
        assert freed == []
        await asyncio.wait_for(back.wait(), 50 * QUARANTINE_TIMEOUTS * settings.peer_timeout)

    asyncio.run(scenario())
    assert freed == [Run(0, 19, 5, "shm")]  # the free part only; the landed run stays
    assert "node-a" not in push.landing.given
