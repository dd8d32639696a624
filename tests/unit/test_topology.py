"""Placing sessions, the registry's version pushes and edge routes, on a real (tiny) arena."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.shm import PROBE_BYTES

from relayd.pools.arena import Arena
from relayd.pools.sessions import Session, Sessions
from relayd.routing.topology import Topology, process_key
from relayd.rpc.frames import frame_sink
from tests.unit._pools import unit_arena


@pytest.fixture
def arena() -> Iterator[Arena]:
    with unit_arena(8) as a:
        yield a


@pytest.fixture
def topo(arena: Arena) -> Topology:
    return Topology("unit", arena, Sessions(8, time.monotonic))


def _bind(t: Topology, stage: str, pid: int, frames: list[pb.SessionFrame]) -> Session:
    s = t.sessions.open(pid=pid, stages=[stage])
    return t.sessions.bind(s.id, s.token, frame_sink(frames.append), pid=pid, uid=0, gid=0)


def _route(t: Topology, s: Session, to: str) -> pb.RouteResponse:
    return t.route(
        s,
        pb.RouteRequest(from_stage=s.stages[0], to_stage=to, encoded_bytes=1 << 20,
                        has_cpu_tensors=True),
    )  # fmt: skip


def test_the_nonce_is_in_the_arena_and_only_there(topo: Topology, arena: Arena) -> None:
    seg = arena.segments[0]
    probe = topo.probe_offset
    assert bytes(seg.mm[probe : probe + PROBE_BYTES]) == topo.nonce
    assert probe + PROBE_BYTES <= seg.data_offset  # never inside slot data


def test_same_process_is_local_object_other_process_shm_wrong_nonce_socket(
    topo: Topology,
) -> None:
    frames: list[pb.SessionFrame] = []
    me = os.getpid()
    w = _bind(topo, "thinker", me, frames)
    assert topo.bound(w, topo.nonce, me) == ("shm", 1)
    assert _route(topo, w, "talker").transport == pb.TRANSPORT_SHM  # reader unknown

    r = _bind(topo, "talker", me, frames)
    path, version = topo.bound(r, topo.nonce, me)
    assert (path, version) == ("shm", 2)
    # the writer heard of the change, the new session did not need to
    assert [f.event[0].registry_version for f in frames if f.event] == [2]
    resp = _route(topo, w, "talker")
    assert (resp.transport, resp.reason, resp.registry_version) == (
        pb.TRANSPORT_LOCAL_OBJECT, "same process", 2
    )  # fmt: skip

    with subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"]) as other:
        try:
            o = _bind(topo, "vocoder", other.pid, frames)
            assert topo.bound(o, topo.nonce, other.pid)[0] == "shm"
            assert _route(topo, w, "vocoder").transport == pb.TRANSPORT_SHM
            x = _bind(topo, "encoder", other.pid, frames)
            assert topo.bound(x, b"\0" * PROBE_BYTES, other.pid)[0] == "socket"
            assert _route(topo, w, "encoder").transport == pb.TRANSPORT_SOCKET
            assert _route(topo, x, "thinker").transport == pb.TRANSPORT_SOCKET
        finally:
            other.kill()

    status = pb.StatusResponse()
    status.sessions.add(session_id=x.id)
    topo.fill_status(status)
    assert status.registry_version == topo.registry.version == 4
    assert {s.stage: s.can_map_shm for s in status.stages} == {
        "thinker": True, "talker": True, "vocoder": True, "encoder": False
    }  # fmt: skip
    assert status.sessions[0].data_path == "socket"
    edges = {(e.from_stage, e.to_stage): e for e in status.edges}
    assert edges[("thinker", "talker")].transport == pb.TRANSPORT_LOCAL_OBJECT
    assert edges[("thinker", "talker")].count == 2

    frames.clear()
    topo.closed(r.id)
    assert [f.event[0].kind for f in frames] == [pb.EVENT_KIND_REGISTRY] * 4  # every live session
    assert _route(topo, w, "talker").transport == pb.TRANSPORT_SHM  # gone: unknown again


def test_an_unidentifiable_process_is_never_the_same_process(topo: Topology) -> None:
    assert process_key(0) == "" and process_key(-1) == ""
    key = process_key(os.getpid())
    assert f":{os.getpid()}:" in key and key.startswith("pid:[")  # pid ns inode, pid, start
    frames: list[pb.SessionFrame] = []
    a = _bind(topo, "a", 0, frames)
    b = _bind(topo, "b", 0, frames)
    topo.bound(a, topo.nonce, 0)
    topo.bound(b, topo.nonce, 0)
    assert _route(topo, a, "b").transport == pb.TRANSPORT_SHM
