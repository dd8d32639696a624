"""A keyed take whose caller gave up before the daemon's answer came.

The daemon consumes the key when it answers the take; an answer that finds
no caller any more must not keep the entry's lease held until its TTL.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from relayd_client import RelayClient, RelayTimeoutError, StaleRefError, _session

from tests._daemon import async_wait_until, running_daemon, wait_until
from tests._daemon import drained as _drained
from tests._fixtures import separate_processes

__all__ = ["separate_processes"]  # the autouse fixture: clients here use the arena

pytestmark = pytest.mark.timeout(120)

PAYLOAD = {"x": torch.arange(75_000, dtype=torch.int32)}  # an arena lease, not inline


def _used(d: Any) -> int:
    return int(d.pool()["used_bytes"])


@pytest.mark.parametrize("how", ["cancelled", "deadline"])
def test_a_take_answered_after_its_caller_gave_up_frees_the_lease(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """``cancelled``: the caller's task is cancelled while the daemon waits for the
    put. ``deadline``: the client's deadline passes before the daemon's (as when
    the daemon answers later than the client's grace allows)."""
    grace = _session._ANSWER_GRACE
    if how == "deadline":
        # The client gives up ~0.2 s in; the daemon waits the take's full 30 s.
        monkeypatch.setattr(_session, "_ANSWER_GRACE", -29.8)

    async def scenario(d: Any) -> None:
        async with RelayClient("thinker", d.socket) as w, RelayClient("talker", d.socket) as r:
            calls = r._conn.session._keyed
            take = asyncio.ensure_future(r.take_key("k", from_stage="thinker", timeout=30))
            # The KeyedTake is on its way once the channel holds its call.
            await async_wait_until(lambda: calls, 10, "the take sent")
            if how == "cancelled":
                take.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await take
            else:
                with pytest.raises(RelayTimeoutError):
                    await asyncio.wait_for(take, 10)
                monkeypatch.setattr(_session, "_ANSWER_GRACE", grace)  # for the calls after
            assert not calls
            await w.put(PAYLOAD, to_stage="talker", request_id="r1", key="k")
            # The daemon hands the put to the take it still holds, and answers a
            # caller who is gone: the reader stays open (its close would not free
            # the lease either: the lease is the writer's, published).
            await async_wait_until(lambda: _used(d) == 0, 10, "the taken lease freed")
            with pytest.raises(StaleRefError):
                await r.take_key("k", from_stage="thinker", timeout=0)

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d), 60))
        wait_until(lambda: _drained(d), 10, "arena back to zero")
