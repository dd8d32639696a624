"""A peer lost mid-batch gives back what its notice connection held.

A peer that vanishes without a FIN (power loss, a partition that never heals)
in the middle of a batch's attached bytes leaves our end of its notice
connection waiting for bytes that never come, holding the arena run placed for
them and the connection's read buffer. Its loss (the heartbeat timeout) must
end that connection; nothing else would for hours.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import socket
from collections.abc import Sequence

import pytest
from relayd_client.wire.proto import relay_pb2 as pb

from relayd import peer_channel
from relayd.peer_channel import NoticeLink, NoticeListener
from tests._daemon import async_wait_until
from tests.unit.test_peer_manager import BOUND, READER, SLOT, pushing_nodes, run, until

pytestmark = pytest.mark.timeout(60)

TOKEN = b"0123456789abcdef-shared-peer-token"


def _hello(node: str, epoch: str) -> pb.PeerNotices:
    return pb.PeerNotices(node_id=node, daemon_epoch=epoch)


def test_a_peer_lost_mid_attached_bytes_has_its_notice_connection_dropped_and_run_freed(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's notice connection to B stops halfway through a push's attached bytes and
    stays open (a frozen sender: no FIN ever comes); then A is taken for lost. B
    drops that connection and the run it placed goes back to the arena with the
    rest of A's voided grant."""

    async def main() -> None:
        async with pushing_nodes(tmp_path, push_attach_max=4 * SLOT) as (a, b, _reader):
            listener = b.peers._notices_in
            assert listener is not None
            gin = b.peers.push.landing.given[a.settings.node_id]
            host, port = "127.0.0.1", b.peers.notice_port
            hello = _hello(a.settings.node_id, a.epoch)
            # This link stands in for A's own, which must not dial again and replace it.
            monkeypatch.setattr(a.peers.notifier, "ensure_channel", lambda peer: None)
            link = await NoticeLink.open(host, port, b.peers.links.token, hello, BOUND)
            try:
                length = 2 * SLOT + 5
                landed = pb.PushLanded(
                    lease_id=1, generation=1, grant_id=gin.grant_id, slot=0, nslots=3,
                    length=length, attached=length, request_id="r", to_stage=READER,
                )  # fmt: skip
                batch = pb.PeerNotices(
                    node_id=a.settings.node_id, daemon_epoch=a.epoch, landed=[landed]
                )
                assert link.send(batch, [os.urandom(length // 2)])
                await until(lambda: gin.used.free_runs() == [(3, gin.run.nslots - 3)], "placed")
                assert len(listener.conns) == 1
                (conn,) = listener.conns
                sock = conn.transport.get_extra_info("socket") if conn.transport else None
                assert sock is not None
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                idle = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
                assert idle == peer_channel.KEEPALIVE_IDLE_S

                await a.close()  # gone: heartbeats fail, the frozen link stays open
                await until(lambda: (a.settings.node_id, None) in b.stage_events, "A's loss")
                await until(lambda: not link.alive, "B to drop A's notice connection")
                assert not listener.conns and not listener.by_node
                assert conn.transport is None and len(conn.buf) == 0
                # The placed run at once, the rest of the grant after its quarantine.
                await until(lambda: b.arena.used_bytes == 0, "the whole grant back in the arena")
                assert not b.leases.leases
            finally:
                link.close()

    run(main())


class _Places:
    """A listener's place and release, counting what it handed out and got back."""

    def __init__(self) -> None:
        self.placed = 0
        self.given_back = 0

    def place(self, batch: pb.PeerNotices) -> list[memoryview]:
        views = peer_channel.scratch(batch)
        self.placed += len(views)
        return views

    def release(self, views: Sequence[memoryview]) -> None:
        self.given_back += len(views)


def test_drop_node_ends_only_that_nodes_connection_and_gives_back_its_places() -> None:
    async def main() -> None:
        up = {("node-w", "epoch-w"), ("node-x", "epoch-x")}
        places = _Places()
        listener = NoticeListener(
            TOKEN, lambda node, epoch: (node, epoch) in up, lambda b, a: None,
            places.place, places.release,
        )  # fmt: skip
        port = await listener.start("127.0.0.1", 0)
        links: list[NoticeLink] = []
        try:
            for node, epoch in sorted(up):
                links.append(
                    await NoticeLink.open("127.0.0.1", port, TOKEN, _hello(node, epoch), 5)
                )
            w, x = links
            await async_wait_until(lambda: len(listener.by_node) == 2, 5, "both accepted")
            batch = pb.PeerNotices(
                node_id="node-w", daemon_epoch="epoch-w",
                landed=[pb.PushLanded(lease_id=1, generation=1, length=100, attached=100)],
            )  # fmt: skip
            assert w.send(batch, [bytes(40)])
            await async_wait_until(lambda: places.placed == 1, 5, "the place asked for")

            listener.drop_node("node-w", "epoch-other")  # not the epoch it was accepted at
            listener.drop_node("node-unknown", "epoch-w")
            assert set(listener.by_node) == {"node-w", "node-x"} and places.given_back == 0

            listener.drop_node("node-w", "epoch-w")
            assert set(listener.by_node) == {"node-x"} and len(listener.conns) == 1
            assert places.given_back == 1
            await async_wait_until(lambda: not w.alive, 5, "W's end to see the close")
            assert x.alive
        finally:
            for link in links:
                link.close()
            await listener.close()

    asyncio.run(asyncio.wait_for(main(), 30))
