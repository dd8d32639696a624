"""A keyed put handed to a waiting take whose caller is gone before it resumes.

The put hands its DataRef to the waiting take at once. When that take ends in
the same daemon turn instead (its reader's connection closed, or its deadline
passed), nobody read the key: it must stay in the index for the next reader,
not be remembered as read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest
from relayd_client import DataRef, RelayTimeoutError, StaleRefError
from relayd_client.wire.dataref import VERSION
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.keys import KeyIndex

NAME = ("talker", "thinker", "k")
LEASE_ID = (7 << 32) + 1
BOUND = 10.0  # no test waits this long unless the behaviour under test is broken


def _ref() -> DataRef:
    m = pb.DataRef(
        version=VERSION, object_id="o1", request_id="r1", chunk_id=-1, to_stage="talker",
        transport=pb.TRANSPORT_SHM, header_codec=pb.HEADER_CODEC_SAFE, header=b"\xb1N",
        origin=pb.Origin(node_id="n", daemon_epoch="e", stage="thinker"),
        lease=pb.LeaseRef(pool="shm", segment=0, slot=3, nslots=2, offset=4096, length=100,
                          generation=LEASE_ID, lease_id=LEASE_ID),
    )  # fmt: skip
    m.tensors.append(pb.TensorLayout(index=0, shape=[25], dtype="float32", offset=0, nbytes=100))
    return DataRef(m)


def _run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, BOUND))


def test_a_key_handed_to_a_take_cancelled_in_the_same_turn_stays_unread() -> None:
    ref = _ref()

    async def scenario() -> None:
        keys = KeyIndex(max_stage_keys=4, ttl=60.0)
        gone_reader = asyncio.create_task(keys.take(NAME, BOUND))
        await asyncio.sleep(0)  # one loop turn: the take now waits for the put
        keys.add(ref, "k")
        gone_reader.cancel()  # its connection ended in the turn the put came
        with pytest.raises(asyncio.CancelledError):
            await gone_reader
        assert len(keys) == 1 and keys.nbytes == len(ref.to_bytes())
        assert await keys.take(NAME, 0) == ref.to_bytes()
        assert (len(keys), keys.nbytes, keys.per_stage.as_dict()) == (0, 0, {})

    _run(scenario())


def test_a_key_handed_back_is_discarded_by_its_lease() -> None:
    ref = _ref()

    async def scenario() -> None:
        keys = KeyIndex(max_stage_keys=4, ttl=60.0)
        gone_reader = asyncio.create_task(keys.take(NAME, BOUND))
        await asyncio.sleep(0)
        keys.add(ref, "k")
        gone_reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone_reader
        keys.discarded(("n", LEASE_ID))
        assert (len(keys), keys.nbytes, keys.per_stage.as_dict()) == (0, 0, {})
        with pytest.raises(StaleRefError):
            await keys.take(NAME, 0)

    _run(scenario())


def test_a_key_handed_to_a_live_take_is_read_once() -> None:
    ref = _ref()

    async def scenario() -> None:
        keys = KeyIndex(max_stage_keys=4, ttl=60.0)
        reader = asyncio.create_task(keys.take(NAME, BOUND))
        await asyncio.sleep(0)
        keys.add(ref, "k")
        assert await reader == ref.to_bytes()
        assert (len(keys), keys.nbytes, keys.per_stage.as_dict()) == (0, 0, {})
        with pytest.raises(StaleRefError):
            await keys.take(NAME, 0)

    _run(scenario())


class _ClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when the test moves it."""

    now = 0.0

    def time(self) -> float:
        return self.now


def test_a_key_handed_to_a_take_whose_deadline_passes_in_the_same_turn_stays_unread() -> None:
    ref = _ref()
    loop = _ClockLoop()

    async def scenario() -> None:
        keys = KeyIndex(max_stage_keys=4, ttl=60.0)
        late_reader = asyncio.create_task(keys.take(NAME, 5.0))
        await asyncio.sleep(0)  # the take waits, its deadline at 5.0
        # The put lands just before the deadline, and both are due in one turn.
        loop.call_at(4.5, keys.add, ref, "k")
        loop.now = 5.0
        with pytest.raises(RelayTimeoutError):
            await late_reader
        assert await keys.take(NAME, 0) == ref.to_bytes()
        assert (len(keys), keys.nbytes, keys.per_stage.as_dict()) == (0, 0, {})

    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()
