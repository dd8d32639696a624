"""A keyed put that reaches the consumer's daemon too late for its caller is not indexed.

A keyed put for a stage served on another node is handed over with a Peer
``KeyedPut`` call, bounded by the peer timeout. When the consumer's daemon
gets to that call only as its deadline passes (its loop was busy), the
writer's daemon has already had DEADLINE_EXCEEDED: it told the writer that the
put failed and freed the put's lease. Indexing the key then would hand the
reader a DataRef the writer was told is gone: a read of a freed lease, and a
KeyExistsError for the writer's retry of the same key.

Two real peer layers in one process (``test_peer_manager``: arenas, lease
tables, the Peer service on real gRPC servers, a loopback transport), each
with the daemon's real keyed calls and key index, wired as the daemon wires
them.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from relayd_client.wire.errors import RelayTimeoutError
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.keys import KeyIndex
from relayd.pools.sessions import Session
from relayd.rpc.keyed import KeyedCalls
from relayd.transports.loopback import Loopback
from tests.unit.test_peer_manager import READER, SLOT, WRITER, Node, peer_token, run, until

pytestmark = pytest.mark.timeout(60)

BOUND = 10.0  # no test waits this long unless the behaviour under test is broken
KEY = "r1_talker_0"
# The caller's own deadline may fall this much after the server's (the timeout
# header's rounding, the request's transit).
CALLER_SLACK = 0.2


def _keyed(node: Node) -> KeyedCalls:
    """``node``'s keyed calls, as the daemon builds them, with its peer layer."""
    keyed = KeyedCalls(
        node.settings.node_id,
        node.epoch,
        leases=node.leases,
        keys=KeyIndex(max_stage_keys=16, ttl=30.0),
        served_here=node.topology.registry.served_here,
    )
    keyed.peers = node.peers
    return keyed


@asynccontextmanager
async def keyed_nodes(
    tmp_path: pathlib.Path, **kw: Any
) -> AsyncIterator[tuple[Node, Node, KeyedCalls]]:
    """The writer's node A and the reader's node B (``kw``: for both), handshaken both
    ways; B takes A's keyed puts into B's index (the keyed calls of B, yielded), and
    takes them back, as a daemon does."""
    token = peer_token(tmp_path)
    loopback = Loopback()
    a = Node("a", loopback, token, **kw)
    b = Node("b", loopback, token, peers=(a.address,), **kw)
    on_b = _keyed(b)
    b.peers.hooks = dataclasses.replace(
        b.peers.hooks, keyed_from_peer=on_b.put_from_peer, keyed_withdraw=on_b.withdraw_from_peer
    )
    try:
        await a.peers.start()
        await b.peers.start()
        yield a, b, on_b
    finally:
        for node in (b, a):
            await node.close()
            node.dispose()


def _busy_until_deadline(node: Node) -> None:
    """``node``'s loop, busy from the arrival of a Peer KeyedPut until its deadline has
    passed, and the caller's with it: the writer's daemon has had its DEADLINE_EXCEEDED
    by the time the handler goes on."""
    links = node.peers.links
    authenticate = links.authenticate

    def late(context: Any, what: str) -> None:
        if what == "keyed put":
            busy_until = time.monotonic() + BOUND
            while context.time_remaining() > 0 and time.monotonic() < busy_until:
                time.sleep(0.01)
            time.sleep(CALLER_SLACK)
        authenticate(context, what)

    links.authenticate = late  # type: ignore[method-assign]


def _poll(key: str) -> pb.KeyedTake:
    return pb.KeyedTake(key=key, from_stage=WRITER, to_stage=READER, timeout_seconds=0)


async def put_for_b(a: Node, b: Node) -> tuple[Session, Session, bytes]:
    """A's writer, B's reader, and a put on A for it once A knows that B serves its stage."""
    writer, reader = a.session(WRITER), b.session(READER)
    await until(lambda: a.peers.serving(READER) is not None, "A to hear B's stages")
    return writer, reader, await a.put(writer, os.urandom(2 * SLOT))


def test_a_keyed_put_that_reaches_the_consumer_after_its_deadline_is_not_indexed(
    tmp_path: pathlib.Path,
) -> None:
    async def main() -> None:
        async with keyed_nodes(tmp_path) as (a, b, on_b):
            writer, reader, ref = await put_for_b(a, b)
            _busy_until_deadline(b)
            with pytest.raises(RelayTimeoutError):
                await _keyed(a).put(writer, pb.KeyedPut(call_id=1, key=KEY, data_ref=ref))
            # The writer was told the put failed, and its lease went with it ...
            assert not a.leases.leases
            # ... so its reader must not find the key.
            assert len(on_b.keys) == 0, "the reader's node indexed a put its writer was told failed"
            assert await on_b.take(reader, _poll(KEY)) == b""

    run(main())


def test_a_keyed_put_handed_over_in_time_is_indexed_on_the_consumers_node(
    tmp_path: pathlib.Path,
) -> None:
    async def main() -> None:
        async with keyed_nodes(tmp_path) as (a, b, on_b):
            writer, reader, ref = await put_for_b(a, b)
            await _keyed(a).put(writer, pb.KeyedPut(call_id=1, key=KEY, data_ref=ref))
            assert len(a.leases.leases) == 1  # held for the reader, who finds it by key
            assert await on_b.take(reader, _poll(KEY)) != b""

    run(main())
