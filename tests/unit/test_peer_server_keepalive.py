"""The Peer gRPC server notices a peer that vanished (its host gone: no FIN, no
RST, no answer) and ends its streams, a ``Notify`` stream among them, within a
bound set by the peer timeout; and it lets a live peer's idle stream be, its
own keepalive pings included.

A real daemon's peer layer serves the Peer service (``test_peer_manager.Node``);
its peer is a real gRPC channel reaching it through a TCP relay that can go
silent, as a vanished host does (:class:`tests._grpc_relay.Relay`).
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.proto import relay_pb2_grpc as pb_grpc

from relayd.peer_links import TOKEN_KEY, channel_options, keepalive_ms
from relayd.rpc.peer_service import PeerService
from relayd.transports.loopback import Loopback
from tests._daemon import async_wait_until
from tests._grpc_relay import ACK, GOAWAY, PING, Relay
from tests.unit.test_peer_manager import PEER_TIMEOUT, Node, peer_token

pytestmark = pytest.mark.timeout(60)

# A vanished peer is noticed once a ping goes unanswered: a ping after
# keepalive_ms of silence (the peer timeout), then as long for its answer; plus
# slack for a busy host.
NOTICED_WITHIN = 2 * keepalive_ms(PEER_TIMEOUT) / 1000 + 5.0
CALL_BOUND = 10.0


class Streams:
    """The Peer service's Notify handler, counting the calls that began and ended."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.began = self.ended = 0
        notify = PeerService.Notify

        async def counted(service: PeerService, requests: Any, context: Any) -> pb.PeerNoticesAck:
            self.began += 1
            try:
                return await notify(service, requests, context)
            finally:
                self.ended += 1

        monkeypatch.setattr(PeerService, "Notify", counted)


@asynccontextmanager
async def served(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Node, Streams, Relay]]:
    """A daemon's Peer service, its Notify calls counted, and a relay to it."""
    token = peer_token(tmp_path)
    streams = Streams(monkeypatch)  # before the server takes its handlers
    node = Node("a", Loopback(), token)
    relay = Relay(node.address)
    try:
        await node.peers.start()
        yield node, streams, relay
    finally:
        await relay.close()
        await node.close()
        node.dispose()


async def open_notify(
    node: Node, relay: Relay, streams: Streams, options: list[tuple[str, Any]]
) -> tuple[grpc.aio.Channel, Any]:
    """A peer's channel through ``relay`` and a Notify stream on it, once the
    service is running it."""
    channel = grpc.aio.insecure_channel(await relay.start(), options=options)
    call = pb_grpc.PeerStub(channel).Notify(metadata=((TOKEN_KEY, node.peers.links.token),))
    await until(lambda: streams.began == 1 or call.done(), "the Notify stream to be served")
    assert not call.done() and streams.ended == 0
    return channel, call


async def until(predicate: Callable[[], Any], what: str, timeout: float = CALL_BOUND) -> None:
    await async_wait_until(predicate, timeout, what)


async def hang_up(channel: grpc.aio.Channel, call: Any) -> None:
    call.cancel()
    await asyncio.wait_for(channel.close(), CALL_BOUND)


def test_a_peer_gone_silent_has_its_notify_stream_ended_by_the_server(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peer's channel has no keepalive of its own: the server alone must notice."""

    async def main() -> None:
        async with served(tmp_path, monkeypatch) as (node, streams, relay):
            channel, call = await open_notify(node, relay, streams, [])
            relay.silent = True  # its host is gone
            await until(
                lambda: relay.server_closed.is_set() and streams.ended == 1,
                "the server to drop the silent peer's connection and end its Notify",
                NOTICED_WITHIN,
            )
            await hang_up(channel, call)

    asyncio.run(asyncio.wait_for(main(), 50))


def test_a_live_idle_peer_keeps_its_notify_stream_through_the_servers_pings(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle stream from a peer that answers is pinged, not dropped."""

    async def main() -> None:
        async with served(tmp_path, monkeypatch) as (node, streams, relay):
            channel, call = await open_notify(node, relay, streams, [])
            await until(
                lambda: relay.count("up", PING, ACK) >= 3,
                "the peer to answer three of the server's pings",
                3 * NOTICED_WITHIN,
            )
            assert not call.done() and streams.ended == 0
            assert relay.count("down", GOAWAY) == 0 and not relay.server_closed.is_set()
            await call.done_writing()
            assert await asyncio.wait_for(call, CALL_BOUND) == pb.PeerNoticesAck()
            await hang_up(channel, call)

    asyncio.run(asyncio.wait_for(main(), 50))


def test_the_server_lets_a_peers_own_keepalive_pings_be(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer's channel (the daemon's own options) pings an idle connection as often
    as the server does; gRPC's server default takes a third such ping within five
    minutes for abuse, and ends the connection (GOAWAY too_many_pings)."""

    async def main() -> None:
        async with served(tmp_path, monkeypatch) as (node, streams, relay):
            options = channel_options(node.settings.peer_timeout)
            channel, call = await open_notify(node, relay, streams, options)
            pings = 8
            await until(
                lambda: relay.count("down", PING, ACK) >= pings or call.done(),
                f"the server to answer {pings} of the peer's pings",
                pings * NOTICED_WITHIN,
            )
            assert relay.count("down", GOAWAY) == 0, "the server refused the peer's pings"
            assert not call.done() and streams.ended == 0
            await call.done_writing()
            assert await asyncio.wait_for(call, CALL_BOUND) == pb.PeerNoticesAck()
            await hang_up(channel, call)

    asyncio.run(asyncio.wait_for(main(), 50))
