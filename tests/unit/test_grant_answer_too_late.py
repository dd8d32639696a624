"""A Grant whose answer cannot reach its caller in time goes back to the pool.

The Grant handler may get its run just before the call's deadline and then
not run again until after it (the daemon's loop was busy): gRPC has already
ended the call for the client, which never learns the grant's id and so can
never give it back. The daemon must not keep such a grant for its session
(space held by nobody, counted against the stage's quota for as long as the
session lives); an answer that does reach the client must stay granted.

The daemon's real service answers here on a real gRPC server; the client is
a plain gRPC stub on another thread, so its deadline runs while the daemon's
loop is held.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.proto import relay_pb2_grpc as pb_grpc

from relayd.keys import KeyIndex
from relayd.pools.arena import Arena
from relayd.pools.leases import LeaseManager
from relayd.pools.sessions import Session, SessionState
from relayd.routing.topology import Topology
from relayd.rpc.admission import Roles
from relayd.rpc.fetch import Fetcher
from relayd.rpc.frames import frame_sink
from relayd.rpc.service import NodeFacts, RelayService
from tests._daemon import async_wait_until
from tests._raw_call import raw_call
from tests.unit._pools import SLOT, unit_arena

BOUND = 10.0  # no test waits this long unless the behaviour under test is broken
CALL_DEADLINE = 2.0  # the client's deadline: time enough for the call to queue


@pytest.fixture
def arena() -> Iterator[Arena]:
    with unit_arena(32) as a:
        yield a


class _Lifecycle:
    drain_grace = 1.0

    def request_stop(self, *, grace: float | None = None) -> None:
        raise AssertionError("no test here drains")


def _service(m: LeaseManager, arena: Arena) -> RelayService:
    return RelayService(
        m,
        facts=NodeFacts("unit", "e", "", "off", 10.0, ""),
        reserve_timeout=BOUND,
        arena=arena,
        gpu_pools=(),
        topology=Topology("unit", arena, m.session_table),
        keys=KeyIndex(max_stage_keys=16, ttl=10.0),
        fetcher=Fetcher("unit", "e", default_timeout=1.0),
        status=pb.StatusResponse,
        roles=Roles(),
        lifecycle=_Lifecycle(),
        on_ref=lambda nbytes: None,
    )


def _session(m: LeaseManager, stage: str) -> Session:
    s = m.open_session(pid=1, stages=[stage])
    return m.bind(s.id, s.token, frame_sink(lambda frame: None), pid=1, uid=0, gid=0)


def _grant_call(
    target: str, s: Session, deadline: float, outcome: list[object], ended: threading.Event
) -> threading.Thread:
    """A raw Grant of one default grant on its own thread; its answer or error goes in ``outcome``."""
    request = pb.GrantRequest(
        session_id=s.id, session_token=s.token, min_bytes=8 * SLOT, timeout_seconds=BOUND
    )
    return raw_call(target, "Grant", request, deadline, outcome, ended)


async def _until(predicate: Callable[[], object], what: str) -> None:
    await async_wait_until(predicate, BOUND, what)


def _manager(arena: Arena) -> LeaseManager:
    return LeaseManager(
        arena, grant_bytes=8 * SLOT, lease_ttl=10.0, stage_quota_bytes=32 * SLOT, max_sessions=8
    )


async def _serving(m: LeaseManager, arena: Arena, tmp_path: Path) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    pb_grpc.add_RelayServicer_to_server(_service(m, arena), server)
    target = f"unix:{tmp_path}/relay.sock"
    server.add_insecure_port(target)
    await server.start()
    return server, target


def test_a_grant_served_after_its_callers_deadline_goes_back(arena: Arena, tmp_path: Path) -> None:
    async def scenario() -> None:
        m = _manager(arena)
        server, target = await _serving(m, arena, tmp_path)
        try:
            holder, writer = _session(m, "thinker"), _session(m, "talker")
            held = [await m.grant(holder, 8 * SLOT, 1.0) for _ in range(4)]
            assert arena.free_slots == 0
            outcome: list[object] = []
            gave_up = threading.Event()
            # The daemon's loop, busy from the turn the wait is served until the
            # client's deadline has passed and its call has ended.
            m.hooks.reserve_wait = lambda seconds: gave_up.wait(BOUND)
            thread = _grant_call(target, writer, CALL_DEADLINE, outcome, gave_up)
            await _until(lambda: m.queue.space_short, "the Grant call never waited for space")
            m.return_grant(holder, held[0].id)  # serves the wait
            assert len(writer.grants) == 1
            await _until(lambda: not thread.is_alive(), "the client's call never ended")
            [err] = outcome
            assert (
                isinstance(err, grpc.RpcError) and err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            )
            for g in held[1:]:
                m.return_grant(holder, g.id)
            await _until(
                lambda: m.granted_slots() == 0,
                f"a grant nobody learnt of is still held: {writer.granted_slots} slots",
            )
            assert writer.state is SessionState.BOUND and not writer.grants
            assert arena.free_slots == arena.capacity_slots
        finally:
            await server.stop(None)

    asyncio.run(asyncio.wait_for(scenario(), 3 * BOUND))


def test_a_grant_answered_in_time_stays_granted(arena: Arena, tmp_path: Path) -> None:
    async def scenario() -> None:
        m = _manager(arena)
        server, target = await _serving(m, arena, tmp_path)
        try:
            writer = _session(m, "talker")
            outcome: list[object] = []
            ended = threading.Event()
            thread = _grant_call(target, writer, BOUND, outcome, ended)
            await _until(lambda: not thread.is_alive(), "the client's call never ended")
            (answer,) = outcome
            assert isinstance(answer, pb.GrantResponse), answer
            # The call is over on both sides: nothing of it may take the grant back.
            await server.stop(BOUND)
            assert m.grants[answer.grant_id] is writer.grants[answer.grant_id]
            assert m.granted_slots() == answer.nslots == 8
        finally:
            await server.stop(None)

    asyncio.run(asyncio.wait_for(scenario(), 3 * BOUND))
