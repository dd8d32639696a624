"""An abort that lands while a key is in a take's hands, before that take returns it.

A keyed put handed to a waiting take is out of the index until the take
resumes; should the take end unread in that turn (its reader's connection
closed, its deadline passed), the key goes back for the next reader. An abort
of the key's request in between must win: its key never comes back. A leased
key that did come back went with the next sweep (its lease was freed); an
inline one stayed readable until its TTL.
"""

from __future__ import annotations

import asyncio

import pytest
from relayd_client import AbortedError, DataRef
from relayd_client.wire.dataref import VERSION
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.keys import KeyIndex
from tests._daemon import async_wait_until

NAME = ("talker", "thinker", "k")
LEASE_ID = (7 << 32) + 1
BOUND = 10.0  # no test waits this long unless the behaviour under test is broken


def _ref(transport: str) -> DataRef:
    m = pb.DataRef(
        version=VERSION, object_id="o1", request_id="r1", chunk_id=-1, to_stage="talker",
        header_codec=pb.HEADER_CODEC_SAFE, header=b"\xb1N",
        origin=pb.Origin(node_id="n", daemon_epoch="e", stage="thinker"),
    )  # fmt: skip
    if transport == "inline":
        m.transport = pb.TRANSPORT_INLINE
    else:
        m.transport = pb.TRANSPORT_SHM
        m.lease.CopyFrom(
            pb.LeaseRef(pool="shm", segment=0, slot=3, nslots=2, offset=4096, length=100,
                        generation=LEASE_ID, lease_id=LEASE_ID)
        )  # fmt: skip
        m.tensors.append(pb.TensorLayout(index=0, shape=[25], dtype="float32", offset=0,
                                         nbytes=100))  # fmt: skip
    return DataRef(m)


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_an_abort_in_the_turn_of_a_hand_back_keeps_the_key_gone(transport: str) -> None:
    ref = _ref(transport)

    async def scenario() -> None:
        keys = KeyIndex(max_stage_keys=4, ttl=60.0)
        gone_reader = asyncio.create_task(keys.take(NAME, BOUND))
        await async_wait_until(lambda: NAME in keys._waiters, BOUND, "the take to wait for the put")
        keys.add(ref, "k")  # handed to the take, which has not resumed yet
        keys.abort("r1")
        gone_reader.cancel()  # its connection ended in the same turn
        with pytest.raises(asyncio.CancelledError):
            await gone_reader
        assert (len(keys), keys.nbytes, keys.per_stage.as_dict()) == (0, 0, {})
        keys.reap(lambda lease: True)  # the sweep: nothing of it is there to expire
        with pytest.raises(AbortedError):
            await keys.take(NAME, 0)

    asyncio.run(asyncio.wait_for(scenario(), BOUND))
