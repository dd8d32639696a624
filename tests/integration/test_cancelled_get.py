"""Gets that end half way (cancelled, or a copy that fails) leave nothing held."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from relayd_client import RelayClient, StaleRefError, SyncRelayClient

from tests._daemon import async_wait_until, running_daemon, wait_until
from tests._daemon import drained as _drained
from tests._fixtures import separate_processes

__all__ = ["separate_processes"]  # the autouse fixture: clients here use the arena

pytestmark = pytest.mark.timeout(120)


def test_a_large_get_cancelled_during_its_copy_frees_its_lease(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy of 8 MiB or more claims the lease first; a claimed lease outlives the
    TTL, so a get cancelled while its worker copies must still release it."""
    from relayd_client import _copies, _writer

    real_to_thread = asyncio.to_thread
    stall = False
    copying: asyncio.Event | None = None

    async def to_thread(func: Any, /, *args: Any, **kwargs: Any) -> Any:
        if stall and func is _copies.run_copies:
            assert copying is not None
            copying.set()
            await asyncio.get_running_loop().create_future()  # until cancelled
        return await real_to_thread(func, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", to_thread)
    payload = {"x": torch.arange(_writer.OFFLOAD_BYTES // 4 + 1024, dtype=torch.int32)}

    async def scenario(d: Any) -> None:
        nonlocal stall, copying
        async with RelayClient("thinker", d.socket) as w, RelayClient("talker", d.socket) as r:
            ref = await w.put(payload, to_stage="talker", request_id="big")
            stall, copying = True, asyncio.Event()
            get = asyncio.ensure_future(r.get(ref))
            await asyncio.wait_for(copying.wait(), 10)
            get.cancel()
            with pytest.raises(asyncio.CancelledError):
                await get
            # The reader stays open: its session's end would free a claim anyway.
            await async_wait_until(lambda: _leases(d) == (0, {}), 10, "the claim released")
            with pytest.raises(StaleRefError):
                await r.get(ref)

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d), 60))
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def test_a_large_blocking_get_whose_copy_fails_frees_its_lease(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The blocking client copies on the caller's thread, claim first: a copy
    that raises (no memory for the tensors) must release the lease too."""
    from relayd_client import _copies, _writer

    real_unpack_from = _copies.unpack_from
    fail = False

    def unpack_from(*args: Any, **kwargs: Any) -> Any:
        if fail:
            raise MemoryError("no room for the tensors")
        return real_unpack_from(*args, **kwargs)

    monkeypatch.setattr(_copies, "unpack_from", unpack_from)
    payload = {"x": torch.arange(_writer.OFFLOAD_BYTES // 4 + 1024, dtype=torch.int32)}
    with running_daemon(str(tmp_path)) as d:
        with SyncRelayClient("thinker", d.socket) as w, SyncRelayClient("talker", d.socket) as r:
            ref = w.put(payload, to_stage="talker", request_id="big")
            fail = True
            with pytest.raises(MemoryError):
                r.get(ref)
            fail = False
            # The reader stays open: its session's end would free a claim anyway.
            wait_until(
                lambda: _leases(d) == (0, {}), 10, "the claim released", state=lambda: _leases(d)
            )
            with pytest.raises(StaleRefError):
                r.get(ref)
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def _leases(d: Any) -> tuple[int, dict[str, Any]]:
    """(used bytes, live leases by state) of the daemon now."""
    states = d.status().get("leases_by_state", {})
    return d.pool().get("used_bytes", 0), {k: v for k, v in states.items() if v != "0"}
