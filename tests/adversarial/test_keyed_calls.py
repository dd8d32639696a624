"""Hostile keyed puts, takes and discards on the session socket: each is answered on
its own call id with an exact code, and neither the session nor the daemon falls over."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from relayd_client import DataRef, RelayClient, StaleRefError
from relayd_client.wire.proto import relay_pb2 as pb

from tests._daemon import Daemon
from tests._figures import count
from tests._workers import digest, make_payload
from tests.adversarial._raw import RawSession, read_frames

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20


@pytest.fixture
def daemon_options() -> dict[str, Any]:
    return {"pool": "32MiB"}


def _results(sess: RawSession, want: int, timeout: float = 20.0) -> dict[int, pb.KeyedResult]:
    """Read frames until ``want`` keyed results arrived (or fail at the deadline)."""
    deadline = time.monotonic() + timeout
    results: dict[int, pb.KeyedResult] = {}
    while len(results) < want:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(results)} of {want} keyed results arrived"
        frames, closed = read_frames(sess.sock, min(left, 0.5))
        assert not closed, "the daemon closed the session"
        results.update((r.call_id, r) for f in frames for r in f.keyed_result)
    return results


def _put_one(d: Daemon) -> DataRef:
    """A real 1 MiB put by stage thinker for stage talker (not keyed)."""

    async def put() -> DataRef:
        async with RelayClient("thinker", d.socket) as w:
            return await w.put(make_payload(1, MiB), to_stage="talker", request_id="q")

    return asyncio.run(asyncio.wait_for(put(), 60))


def _forged(ref: DataRef, **origin: str) -> bytes:
    m = pb.DataRef()
    m.CopyFrom(ref.proto)
    for field, value in origin.items():
        setattr(m.origin, field, value)
    return DataRef(m).to_bytes()


def test_keyed_puts_that_name_what_the_session_does_not_own_are_refused(daemon: Daemon) -> None:
    ref = _put_one(daemon)
    sess = RawSession(daemon.socket, "intruder")
    calls = [
        pb.KeyedPut(call_id=1, key="k", data_ref=b"not a dataref"),
        pb.KeyedPut(call_id=2, key="has space", data_ref=ref.to_bytes()),
        pb.KeyedPut(call_id=3, key="x" * 257, data_ref=ref.to_bytes()),
        pb.KeyedPut(call_id=4, key="k\n", data_ref=ref.to_bytes()),
        # Another stage's put: the writer names itself, and it is not this session.
        pb.KeyedPut(call_id=5, key="k", data_ref=ref.to_bytes()),
        # Claiming to be the writer does not make thinker's lease ours.
        pb.KeyedPut(call_id=6, key="k", data_ref=_forged(ref, stage="intruder")),
        pb.KeyedPut(call_id=7, key="k", data_ref=_forged(ref, stage="intruder", node_id="x")),
    ]
    sess.send(pb.SessionFrame(keyed_put=calls))
    got = _results(sess, len(calls))
    assert {i: r.code for i, r in got.items()} == {
        1: pb.ERROR_CODE_CORRUPT_REF,
        2: pb.ERROR_CODE_INVALID_ARGUMENT,
        3: pb.ERROR_CODE_INVALID_ARGUMENT,
        4: pb.ERROR_CODE_INVALID_ARGUMENT,
        5: pb.ERROR_CODE_PERMISSION_DENIED,
        6: pb.ERROR_CODE_STALE_REF,
        7: pb.ERROR_CODE_INVALID_ARGUMENT,
    }
    # A take for a stage the session does not serve, and odd deadlines: a poll.
    takes = [
        pb.KeyedTake(call_id=10, key="k", from_stage="thinker", to_stage="talker"),
        pb.KeyedTake(call_id=11, key="k", from_stage="bad name!", to_stage="intruder"),
        pb.KeyedTake(
            call_id=12,
            key="k",
            from_stage="thinker",
            to_stage="intruder",
            timeout_seconds=float("nan"),
        ),
        pb.KeyedTake(
            call_id=13, key="k", from_stage="thinker", to_stage="intruder", timeout_seconds=-1.0
        ),
    ]
    sess.send(pb.SessionFrame(keyed_take=takes))
    got = _results(sess, len(takes))
    assert {i: (r.code, r.data_ref) for i, r in got.items()} == {
        10: (pb.ERROR_CODE_PERMISSION_DENIED, b""),
        11: (pb.ERROR_CODE_INVALID_ARGUMENT, b""),
        12: (pb.ERROR_CODE_UNSPECIFIED, b""),
        13: (pb.ERROR_CODE_UNSPECIFIED, b""),
    }
    # Discards: garbage, and a forged generation, free nothing.
    bad_gen = pb.DataRef()
    bad_gen.CopyFrom(ref.proto)
    bad_gen.lease.generation += 1
    discards = [
        pb.DiscardCall(call_id=20, data_ref=b"\x00" * 64),
        pb.DiscardCall(call_id=21, data_ref=DataRef(bad_gen).to_bytes()),
        pb.DiscardCall(call_id=22, data_ref=_forged(ref, daemon_epoch="old")),
    ]
    sess.send(pb.SessionFrame(discard=discards))
    got = _results(sess, len(discards))
    assert {i: r.code for i, r in got.items()} == {
        20: pb.ERROR_CODE_CORRUPT_REF,
        21: pb.ERROR_CODE_STALE_REF,
        22: pb.ERROR_CODE_STALE_EPOCH,
    }
    count("hostile keyed calls refused", len(calls) + len(takes) + len(discards))
    sess.close()

    # The lease nobody could touch is still the talker's to read, once.
    async def read() -> None:
        async with RelayClient("talker", daemon.socket) as r:
            assert digest(await r.get(ref)) == digest(make_payload(1, MiB))
            with pytest.raises(StaleRefError):
                await r.discard(ref)

    asyncio.run(asyncio.wait_for(read(), 60))


def test_waiting_takes_are_bounded_per_session_and_end_with_it(daemon: Daemon) -> None:
    from relayd.rpc.session import MAX_KEYED_CALLS

    sess = RawSession(daemon.socket, "talker")
    takes = [
        pb.KeyedTake(
            call_id=i + 1,
            key=f"k{i}",
            from_stage="thinker",
            to_stage="talker",
            timeout_seconds=60.0,
        )
        for i in range(MAX_KEYED_CALLS + 1)
    ]
    sess.send(pb.SessionFrame(keyed_take=takes))
    (over,) = _results(sess, 1).values()
    assert over.call_id == MAX_KEYED_CALLS + 1
    assert over.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED
    sess.close()  # the waits end with the session

    # A new reader of the same keys is served at once: nothing of the dead
    # session's waits took the put meant for it.
    async def scenario() -> None:
        async with (
            RelayClient("thinker", daemon.socket) as w,
            RelayClient("talker", daemon.socket) as r,
        ):
            await w.put(make_payload(2, MiB), to_stage="talker", request_id="q", key="k0")
            got = await r.get_key("k0", from_stage="thinker", timeout=10)
            assert digest(got) == digest(make_payload(2, MiB))

    asyncio.run(asyncio.wait_for(scenario(), 60))
