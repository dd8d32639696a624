"""A put after a cancelled one is readable: the Cancel must not clear the next lease's header.

A writer frees a cancelled lease's slots at once and cuts its next lease from
them; the Cancel lingers in the pending frame with that lease's Reserve. The
daemon used to zero the cancelled lease's slot header when it heard the
Cancel, which by then was the next lease's, sealed: its reader failed with
``StaleRefError``, and the lease stayed published until its TTL.
"""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch
from relayd_client import DataRef, RelayClient

from tests._daemon import Daemon, wait_until
from tests._daemon import drained as _drained
from tests._workers import digest

pytestmark = pytest.mark.timeout(120)


class _Failed(Exception):
    pass


def _published(d: Daemon, n: int) -> bool:
    return d.status()["transfers_by_transport"].get("shm") == str(n)


def test_a_put_right_after_a_cancelled_buffer_is_read_as_sent(daemon: Daemon) -> None:
    payload = {"h": torch.arange(100_000, dtype=torch.float32)}

    async def scenario() -> None:
        async with (
            RelayClient("thinker", daemon.socket) as w,
            RelayClient("talker", daemon.socket) as r,
        ):
            for i in range(3):
                with pytest.raises(_Failed):
                    async with w.buffer(to_stage="talker", request_id=f"bad{i}", like=payload):
                        raise _Failed  # the block fails: its lease is cancelled
                ref = await w.put(payload, to_stage="talker", request_id=f"good{i}")
                # A reader in another process reads once the daemon has the frame.
                w._conn.flush()
                published = functools.partial(_published, daemon, i + 1)
                await asyncio.to_thread(wait_until, published, 10, f"{i + 1} published")
                got = await r.get(DataRef.from_bytes(ref.to_bytes()))
                assert digest(got) == digest(payload)

    asyncio.run(asyncio.wait_for(scenario(), 60))
    wait_until(lambda: _drained(daemon), 10, "arena back to zero")
