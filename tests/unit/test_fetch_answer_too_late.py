"""A Fetch whose answer cannot reach its caller in time gives its lease back.

The pull may land just before the call's deadline, and the Fetch handler then
not run again until after it (the daemon's loop was busy): gRPC has already
ended the call for the reader, which never learns the local lease and so can
never release it. The daemon must not keep such a lease (arena space held by
nobody until its TTL); an answer that does reach the reader must stay leased.

Two real peer layers in one process (``test_peer_manager``: arenas, lease
tables, the Peer service, a loopback transport for Mooncake); the reader's
node serves its real Relay service on a real gRPC server, called by a plain
gRPC stub on another thread, so the caller's deadline runs while the daemon's
loop is held.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import threading

import grpc
import pytest
from relayd_client.wire.errors import RelayTimeoutError
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.proto import relay_pb2_grpc as pb_grpc
from relayd_client.wire.status import from_rpc_error

from relayd.keys import KeyIndex
from relayd.pools.sessions import Session
from relayd.rpc.admission import Roles
from relayd.rpc.fetch import Fetcher
from relayd.rpc.service import NodeFacts, RelayService
from tests._raw_call import raw_call
from tests.unit.test_peer_manager import READER, SLOT, WRITER, Node, run, two_nodes, until

pytestmark = pytest.mark.timeout(60)

BOUND = 10.0  # no test waits this long unless the behaviour under test is broken
CALL_DEADLINE = 2.0  # the reader's deadline: time enough for the pull to start


class _Lifecycle:
    drain_grace = 1.0

    def request_stop(self, *, grace: float | None = None) -> None:
        raise AssertionError("no test here drains")


async def _serving(node: Node, tmp_path: pathlib.Path) -> tuple[grpc.aio.Server, str]:
    """``node``'s Relay service on a gRPC server, its fetches pulled by its peer layer."""
    fetcher = Fetcher(node.settings.node_id, node.epoch, default_timeout=BOUND)
    fetcher.peers = node.peers
    service = RelayService(
        node.leases,
        facts=NodeFacts(node.settings.node_id, node.epoch, "", "off", 30.0, node.address),
        reserve_timeout=BOUND,
        arena=node.arena,
        gpu_pools=(),
        topology=node.topology,
        keys=KeyIndex(max_stage_keys=16, ttl=30.0),
        fetcher=fetcher,
        status=pb.StatusResponse,
        roles=Roles(),
        lifecycle=_Lifecycle(),
        on_ref=lambda nbytes: None,
    )
    server = grpc.aio.server()
    pb_grpc.add_RelayServicer_to_server(service, server)
    target = f"unix:{tmp_path}/relay.sock"
    server.add_insecure_port(target)
    await server.start()
    return server, target


def _fetch_call(
    target: str,
    reader: Session,
    ref: bytes,
    deadline: float,
    outcome: list[object],
    ended: threading.Event,
) -> threading.Thread:
    """A raw Fetch of ``ref`` on its own thread; its answer or its error goes in ``outcome``."""
    request = pb.FetchRequest(
        session_id=reader.id, session_token=reader.token, data_ref=ref, timeout_seconds=BOUND
    )
    return raw_call(target, "Fetch", request, deadline, outcome, ended)


def _held(node: Node) -> bool:
    return bool(node.leases.leases) or node.arena.used_bytes > 0


def test_a_fetch_pulled_after_its_callers_deadline_gives_its_lease_back(
    tmp_path: pathlib.Path,
) -> None:
    async def main() -> None:
        async with two_nodes(tmp_path) as (a, b):
            writer, reader = a.session(WRITER), b.session(READER)
            ref = await a.put(writer, os.urandom(3 * SLOT + 123))
            server, target = await _serving(b, tmp_path)
            try:
                outcome: list[object] = []
                gave_up = threading.Event()
                # The reader's loop, busy from the turn the pull lands until the
                # caller's deadline has passed and its call has ended.
                b.peers.puller.hooks = dataclasses.replace(
                    b.peers.puller.hooks, pull_seconds=lambda seconds: gave_up.wait(BOUND)
                )
                gate = b.transport.hold()
                thread = _fetch_call(target, reader, ref, CALL_DEADLINE, outcome, gave_up)
                await gate.entered(BOUND)
                gate.release()
                await until(lambda: not thread.is_alive(), "the caller's Fetch to end", BOUND)
                [err] = outcome
                assert isinstance(err, grpc.RpcError), err
                assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                assert type(from_rpc_error(err)) is RelayTimeoutError
                await until(
                    lambda: not _held(b),
                    "the reader's node to give back the lease nobody learnt of",
                    BOUND,
                )
                # The copy was verified before the answer was given up: the writer's
                # lease went as after any pull.
                await until(lambda: not a.leases.leases, "the writer's lease to go", BOUND)
            finally:
                await server.stop(None)

    run(main())


def test_a_fetch_answered_in_time_stays_leased_to_its_reader(tmp_path: pathlib.Path) -> None:
    async def main() -> None:
        async with two_nodes(tmp_path) as (a, b):
            writer, reader = a.session(WRITER), b.session(READER)
            data = os.urandom(3 * SLOT + 123)
            ref = await a.put(writer, data)
            server, target = await _serving(b, tmp_path)
            try:
                outcome: list[object] = []
                ended = threading.Event()
                thread = _fetch_call(target, reader, ref, BOUND, outcome, ended)
                await until(lambda: not thread.is_alive(), "the caller's Fetch to end", BOUND)
                [answer] = outcome
                assert isinstance(answer, pb.FetchResponse), answer
                # The call is over on both sides: nothing of it may take the lease back.
                await server.stop(BOUND)
                assert b.read(answer.lease) == data
                assert list(b.leases.leases) == [answer.lease.lease_id]
                b.release(reader, answer.lease)
                assert not _held(b)
            finally:
                await server.stop(None)

    run(main())
