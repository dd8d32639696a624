"""Which node holds a keyed put: only a session that really serves the consumer stage
keeps it here.

A session attached but never bound may never bind, and an operator's session
(the CLI's) moves no data; neither reads keys. Counting them as serving the
stage kept a put on this node while the stage's real reader, on a peer, waited
for it in vain; and made this node accept a peer's put that nobody here reads.
Real lease table, sessions, stage registry, key index and keyed calls, each
session registered as the daemon does it (a data session when it binds, an
operator's never); the peer layer is the one stand-in, recording where a put
was sent.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

import pytest
from relayd_client import DataRef, NotFoundError
from relayd_client.wire.dataref import VERSION
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.keys import KeyIndex
from relayd.pools.leases import LeaseManager
from relayd.pools.sessions import Session
from relayd.routing.registry import StageRegistry
from relayd.routing.router import Placement
from relayd.rpc.frames import frame_sink
from relayd.rpc.keyed import KeyedCalls
from tests.unit._pools import SLOT, unit_arena

NODE, EPOCH, PEER = "node-a", "e1", "node-b"
BOUND = 10.0  # no test waits this long unless the behaviour under test is broken


class _PeerServing:
    """A peer that serves ``stage``: the keyed puts handed to it."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.sent: list[str] = []

    @property
    def push(self) -> Any:
        raise AssertionError("an inline put has no lease to have been pushed")

    def serving(self, stage: str) -> Any:
        return PEER if stage == self.stage else None

    async def keyed_put(
        self, peer: Any, key: str, data_ref: bytes, timeout: float | None = None
    ) -> None:
        self.sent.append(key)

    async def release_now(self, m: pb.DataRef, stages: tuple[str, ...]) -> bool:
        raise AssertionError("no discard here")


def _inline(origin: str = NODE, epoch: str = EPOCH) -> DataRef:
    return DataRef(
        pb.DataRef(
            version=VERSION, object_id="o1", request_id="r1", chunk_id=-1, to_stage="talker",
            transport=pb.TRANSPORT_INLINE, header_codec=pb.HEADER_CODEC_SAFE, header=b"\xb1N",
            origin=pb.Origin(node_id=origin, daemon_epoch=epoch, stage="thinker"),
        )
    )  # fmt: skip


@pytest.fixture
def manager() -> Iterator[LeaseManager]:
    with unit_arena(8) as arena:
        yield LeaseManager(
            arena, grant_bytes=2 * SLOT, lease_ttl=10.0, stage_quota_bytes=8 * SLOT,
            max_sessions=8,
        )  # fmt: skip


def _session(manager: LeaseManager, stage: str) -> Session:
    s = manager.session_table.open(pid=os.getpid(), stages=[stage])
    return manager.session_table.bind(
        s.id, s.token, frame_sink(lambda _f: None), pid=os.getpid(), uid=0, gid=0
    )


def _bound(manager: LeaseManager, registry: StageRegistry, stage: str) -> Session:
    """A data session, registered as the daemon's Topology.bound does."""
    s = _session(manager, stage)
    registry.register(s.id, Placement(NODE, f"pid:{os.getpid()}", "", True, (), (stage,)))
    return s


def _calls(manager: LeaseManager, registry: StageRegistry) -> tuple[KeyedCalls, _PeerServing]:
    keys = KeyIndex(max_stage_keys=4, ttl=60.0)
    keyed = KeyedCalls(NODE, EPOCH, leases=manager, keys=keys, served_here=registry.served_here)
    peer = _PeerServing("talker")
    keyed.peers = peer
    return keyed, peer


def _unbound(manager: LeaseManager) -> None:
    manager.session_table.open(pid=os.getpid(), stages=["talker"])


def _operator(manager: LeaseManager) -> None:
    _session(manager, "talker")  # bound, but the daemon never registers an operator's


BYSTANDERS = pytest.mark.parametrize(
    "bystander", [_unbound, _operator], ids=["unbound", "operator"]
)


@BYSTANDERS
def test_a_keyed_put_reaches_the_peer_that_serves_its_stage(
    manager: LeaseManager, bystander: Any
) -> None:
    registry = StageRegistry(NODE)
    keyed, peer = _calls(manager, registry)
    writer = _bound(manager, registry, "thinker")
    bystander(manager)  # names the stage, reads nothing
    call = pb.KeyedPut(call_id=1, key="k", data_ref=_inline().to_bytes())
    asyncio.run(asyncio.wait_for(keyed.put(writer, call), BOUND))
    assert peer.sent == ["k"]
    assert len(keyed.keys) == 0


@BYSTANDERS
def test_a_peers_put_for_a_stage_nobody_here_reads_is_refused(
    manager: LeaseManager, bystander: Any
) -> None:
    keyed, _peer = _calls(manager, StageRegistry(NODE))
    bystander(manager)
    with pytest.raises(NotFoundError):
        keyed.put_from_peer(PEER, "k", _inline(origin=PEER).to_bytes())
    assert len(keyed.keys) == 0


def test_a_bound_reader_of_the_stage_keeps_the_put_here(manager: LeaseManager) -> None:
    registry = StageRegistry(NODE)
    keyed, peer = _calls(manager, registry)
    writer = _bound(manager, registry, "thinker")
    _bound(manager, registry, "talker")
    call = pb.KeyedPut(call_id=1, key="k", data_ref=_inline().to_bytes())
    asyncio.run(asyncio.wait_for(keyed.put(writer, call), BOUND))
    keyed.put_from_peer(PEER, "k2", _inline(origin=PEER).to_bytes())
    assert peer.sent == []
    assert len(keyed.keys) == 2
