"""The loopback transport keeps the contract's last rule: after ``close()`` nothing
it started writes into local memory, also a held transfer whose gate had just
opened when the transport closed."""

from __future__ import annotations

import asyncio
import ctypes
import mmap

import pytest

from relayd.transports.base import MemoryRegion, PullOp, PullTimeoutError
from relayd.transports.loopback import Loopback

BOUND = 10.0  # every wait below; a hang check, not a performance assertion


def test_a_held_pull_released_just_before_close_writes_nothing_after_it() -> None:
    async def main() -> None:
        bufs = [mmap.mmap(-1, 4096), mmap.mmap(-1, 4096)]
        anchors = [ctypes.c_char.from_buffer(buf) for buf in bufs]
        reg_a, reg_b = (
            MemoryRegion(f"r{i}", ctypes.addressof(anchor), 4096)
            for i, anchor in enumerate(anchors)
        )
        net = Loopback()
        a, b = net.transport(), net.transport()
        await a.start()
        await b.start()
        await a.register(reg_a)
        await b.register(reg_b)
        bufs[0][:16] = b"w" * 16
        op = [PullOp(reg_b.base, reg_a.base, 16)]
        gate = b.hold()
        with pytest.raises(PullTimeoutError) as late:
            await b.pull(a.session_id, op, timeout=0)
        await gate.entered(BOUND)
        assert late.value.in_flight is True
        gate.release()  # the late completion is on its way ...
        await b.close()  # ... when the daemon stops, in the same turn
        await asyncio.wait_for(late.value.settled, BOUND)
        await asyncio.wait_for(b.wait_settled(op), BOUND)
        assert bufs[1][:16] == bytes(16)
        assert b.transfers == 0
        await a.close()
        del anchors
        for buf in bufs:
            buf.close()

    asyncio.run(asyncio.wait_for(main(), 60))
