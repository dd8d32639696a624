"""The registry's edge records stay bounded whatever stage names writers route to."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.transport import Transport

from relayd.pools.sessions import Session, Sessions
from relayd.routing.registry import MAX_EDGES, StageRegistry
from relayd.routing.router import Placement, Route
from relayd.routing.topology import Topology
from relayd.rpc.frames import frame_sink
from tests.unit._pools import unit_arena


@pytest.fixture
def topo() -> Iterator[Topology]:
    with unit_arena(8) as arena:
        yield Topology("unit", arena, Sessions(8, time.monotonic))


def _bind(t: Topology, stage: str) -> Session:
    pid = os.getpid()
    s = t.sessions.open(pid=pid, stages=[stage])
    s = t.sessions.bind(s.id, s.token, frame_sink(lambda f: None), pid=pid, uid=0, gid=0)
    t.bound(s, t.nonce, pid)
    return s


def _route(t: Topology, s: Session, to: str) -> pb.RouteResponse:
    req = pb.RouteRequest(from_stage=s.stages[0], to_stage=to, encoded_bytes=1 << 20)
    return t.route(s, req)


def test_routes_to_names_nobody_serves_do_not_grow_the_edges_without_bound(
    topo: Topology,
) -> None:
    writer = _bind(topo, "thinker")
    _bind(topo, "talker")
    assert _route(topo, writer, "talker").transport == pb.TRANSPORT_LOCAL_OBJECT
    for i in range(2 * MAX_EDGES):
        _route(topo, writer, f"ghost-{i}")
    edges = topo.registry.edges()
    assert len(edges) == MAX_EDGES
    # the edge between two attached stages outlives the flood; the newest ghosts stay
    assert edges[("thinker", "talker")].route.transport is Transport.LOCAL_OBJECT
    assert ("thinker", f"ghost-{2 * MAX_EDGES - 1}") in edges
    assert ("thinker", "ghost-0") not in edges


def test_edges_to_stages_that_came_and_went_are_bounded_too() -> None:
    reg = StageRegistry("n1")
    reg.register("w", Placement("n1", "ns:1:1", "ipc", True, (), ("thinker",)))
    route = Route(Transport.SHM, "other process")
    for i in range(MAX_EDGES + 10):
        reg.register(f"r{i}", Placement("n1", f"ns:{i + 2}:1", "ipc", True, (), (f"st-{i}",)))
        reg.note_edge("thinker", f"st-{i}", route)
        reg.unregister(f"r{i}")
    assert len(reg.edges()) == MAX_EDGES
    assert ("thinker", f"st-{MAX_EDGES + 9}") in reg.edges()
