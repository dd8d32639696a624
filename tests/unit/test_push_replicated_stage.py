"""A push when the consumer stage is served on two other nodes: three nodes in one
process on real parts (see ``test_peer_manager``), the Mooncake WRITE a loopback
transfer. The DataRef may reach a reader on either node; both must read it."""

from __future__ import annotations

import os
import pathlib

import pytest

from relayd.transports.loopback import Loopback
from tests.unit.test_peer_manager import (
    BOUND,
    READER,
    SLOT,
    WRITER,
    Node,
    _sha,
    _up,
    peer_token,
    run,
    until,
)

pytestmark = pytest.mark.timeout(60)


def test_a_put_whose_stage_two_nodes_serve_is_read_on_either(tmp_path: pathlib.Path) -> None:
    token = peer_token(tmp_path)
    loopback = Loopback()

    async def main() -> None:
        grant = 16 * SLOT
        a = Node("a", loopback, token, push_grant_size=grant)
        b = Node("b", loopback, token, peers=(a.address,), push_grant_size=grant)
        c = Node("c", loopback, token, peers=(a.address,), push_grant_size=grant)
        nodes = (c, b, a)
        try:
            for node in (a, b, c):
                await node.peers.start()
            await until(lambda: all(_up(a, r) and _up(r, a) for r in (b, c)), "handshakes")
            readers = {b.address: (b, b.session(READER)), c.address: (c, c.session(READER))}
            push = a.peers.push
            await until(lambda: b.address in push.out and c.address in push.out, "push grants")
            await until(
                lambda: all(READER in a.peers.links.peers[r].stages for r in readers), "stages"
            )
            writer = a.session(WRITER)
            # The application, not relayd, picks which of them gets each DataRef.
            for i, (node, reader) in enumerate(readers.values()):
                data = os.urandom(2 * SLOT + 5)
                ref = await a.put(writer, data, push=True, request_id=f"r{i}")
                local = await node.peers.fetch(reader, ref, BOUND)
                assert _sha(node.read(local)) == _sha(data)
                node.release(reader, local)
            await until(lambda: not a.leases.leases, "the writer's leases freed")
            assert a.credits_out() == 0
        finally:
            for node in nodes:
                await node.close()
                node.dispose()

    run(main())
