"""A socket-fallback put whose answer cannot reach its writer in time leaves no lease.

``PutBytes`` may get its space just before the call's deadline, and the
handler then not run again until after it (the daemon's loop was busy): gRPC
has already ended the call for the writer, which never learns the DataRef and
so can hand it to nobody. The daemon must not keep such a lease published
(arena space held by nobody until its TTL); a put answered in time must stay
published for its reader.

The daemon's real service answers on a real gRPC server; the writer is a
plain gRPC stub on another thread, so its deadline runs while the daemon's
loop is held.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import grpc
import pytest
from relayd_client.wire.errors import RelayTimeoutError
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.status import from_rpc_error

from relayd.pools.arena import Arena
from relayd.pools.sessions import Session
from tests._raw_call import raw_call
from tests.unit._pools import SLOT
from tests.unit.test_grant_answer_too_late import (
    BOUND,
    CALL_DEADLINE,
    _manager,
    _serving,
    _session,
    _until,
    arena,
)

__all__ = ["arena"]  # the fixture, shared with test_grant_answer_too_late

pytestmark = pytest.mark.timeout(60)

DATA = os.urandom(3 * SLOT + 123)


def _put_call(
    target: str, s: Session, deadline: float, outcome: list[object], ended: threading.Event
) -> threading.Thread:
    """A raw PutBytes of :data:`DATA` on its own thread; its answer or its error goes in
    ``outcome``."""
    request = pb.PutBytesRequest(
        session_id=s.id,
        session_token=s.token,
        data=DATA,
        request_id="r1",
        to_stage="talker",
        from_stage="thinker",
        timeout_seconds=BOUND,
    )
    return raw_call(target, "PutBytes", request, deadline, outcome, ended)


def test_a_put_published_after_its_callers_deadline_leaves_no_lease(
    arena: Arena, tmp_path: Path
) -> None:
    async def scenario() -> None:
        m = _manager(arena)
        server, target = await _serving(m, arena, tmp_path)
        try:
            holder, writer = _session(m, "talker"), _session(m, "thinker")
            held = [await m.grant(holder, 8 * SLOT, 1.0) for _ in range(4)]
            assert arena.free_slots == 0
            outcome: list[object] = []
            gave_up = threading.Event()
            # The daemon's loop, busy from the turn the put's wait for space is
            # served until the writer's deadline has passed and its call has ended.
            m.hooks.reserve_wait = lambda seconds: gave_up.wait(BOUND)
            thread = _put_call(target, writer, CALL_DEADLINE, outcome, gave_up)
            await _until(lambda: m.queue.space_short, "the PutBytes call never waited for space")
            m.return_grant(holder, held[0].id)  # serves the wait
            await _until(lambda: not thread.is_alive(), "the writer's call never ended")
            [err] = outcome
            assert isinstance(err, grpc.RpcError), err
            assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert type(from_rpc_error(err)) is RelayTimeoutError
            for g in held[1:]:
                m.return_grant(holder, g.id)
            await _until(
                lambda: not m.leases,
                f"a put nobody learnt of is still published: leases {sorted(m.leases)}",
            )
            assert arena.free_slots == arena.capacity_slots
        finally:
            await server.stop(None)

    asyncio.run(asyncio.wait_for(scenario(), 3 * BOUND))


def test_a_put_answered_in_time_stays_published(arena: Arena, tmp_path: Path) -> None:
    async def scenario() -> None:
        m = _manager(arena)
        server, target = await _serving(m, arena, tmp_path)
        try:
            writer = _session(m, "thinker")
            outcome: list[object] = []
            ended = threading.Event()
            thread = _put_call(target, writer, BOUND, outcome, ended)
            await _until(lambda: not thread.is_alive(), "the writer's call never ended")
            [answer] = outcome
            assert isinstance(answer, pb.PutBytesResponse), answer
            # The call is over on both sides: nothing of it may take the lease back.
            await server.stop(BOUND)
            lease = m.leases[answer.lease.lease_id]
            assert lease.generation == answer.lease.generation and lease.nbytes == len(DATA)
            reader = _session(m, "talker")
            got = m.get_bytes(reader, lease.id, lease.generation, "r1")
            assert got == DATA and not m.leases
        finally:
            await server.stop(None)

    asyncio.run(asyncio.wait_for(scenario(), 3 * BOUND))
