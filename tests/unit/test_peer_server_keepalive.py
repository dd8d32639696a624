"""The Peer gRPC server notices a peer that vanished (its host gone: no FIN, no
RST, no answer) and ends its streams, a ``Notify`` stream among them, within a
bound set by the peer timeout; and it lets a live peer's idle stream be, its
own keepalive pings included.

A real daemon's peer layer serves the Peer service (``test_peer_manager.Node``);
its peer is a real gRPC channel reaching it through :class:`Relay`, a TCP relay
that tallies the HTTP/2 frames each way and can go silent, as a vanished host
does: from then on it passes nothing either way and answers nothing.
"""

from __future__ import annotations

import asyncio
import collections
import os
import pathlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any

import grpc
import pytest
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.proto import relay_pb2_grpc as pb_grpc

from relayd.peer_links import TOKEN_KEY, channel_options, keepalive_ms
from relayd.rpc.peer_service import PeerService
from relayd.transports.loopback import Loopback
from tests._daemon import async_wait_until
from tests.unit.test_peer_manager import PEER_TIMEOUT, Node

pytestmark = pytest.mark.timeout(60)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEAD = 9
PING, GOAWAY = 6, 7
ACK = 0x1
# A vanished peer is noticed once a ping goes unanswered: a ping after
# keepalive_ms of silence (the peer timeout), then as long for its answer; plus
# slack for a busy host.
NOTICED_WITHIN = 2 * keepalive_ms(PEER_TIMEOUT) / 1000 + 5.0
CALL_BOUND = 10.0


class Relay:
    """Relays one TCP connection at a time to ``port``, counting HTTP/2 frames by
    (direction, type, flags); ``silent``: nothing more crosses, either way."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.frames: collections.Counter[tuple[str, int, int]] = collections.Counter()
        self.silent = False
        self.server_closed = asyncio.Event()
        self._server: asyncio.AbstractServer | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    def count(self, direction: str, kind: int, flags: int = 0) -> int:
        return self.frames[direction, kind, flags]

    async def _relay(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        s_reader, s_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self._writers += [c_writer, s_writer]
        to_server = asyncio.ensure_future(self._pump("up", c_reader, s_writer, len(PREFACE)))
        to_client = asyncio.ensure_future(self._pump("down", s_reader, c_writer, 0))
        self._tasks |= {to_server, to_client}
        to_client.add_done_callback(lambda _: self.server_closed.set())

    async def _pump(
        self, direction: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, skip: int
    ) -> None:
        with suppress(asyncio.IncompleteReadError, ConnectionError):
            self._pass(writer, await reader.readexactly(skip))
            while True:
                head = await reader.readexactly(FRAME_HEAD)
                body = await reader.readexactly(int.from_bytes(head[:3], "big"))
                if not self.silent:
                    self.frames[direction, head[3], head[4]] += 1
                self._pass(writer, head + body)

    def _pass(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        if not self.silent and not writer.is_closing():
            writer.write(data)

    async def close(self) -> None:
        for writer in self._writers:
            writer.transport.abort()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


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
    token = tmp_path / "token"
    token.write_bytes(os.urandom(32).hex().encode())
    token.chmod(0o600)
    streams = Streams(monkeypatch)  # before the server takes its handlers
    node = Node("a", Loopback(), token)
    relay = Relay(int(node.address.rpartition(":")[2]))
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
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{await relay.start()}", options=options)
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
