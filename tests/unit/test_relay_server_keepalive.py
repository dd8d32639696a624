"""The Relay gRPC server drops a client that stopped answering (a stopped
process, say) within its keepalive time plus its keepalive timeout, while a
call of it is open; and it lets a live client's idle call be, the client's own
channel options and pings included.

The server is built as the daemon builds it (``server.grpc_server_options``,
its keepalive shortened here so that a test can wait for it) and serves the
daemon's health service, whose Watch is a call that stays open; the client is a
real gRPC channel with the client's options, reaching it through
:class:`tests._grpc_relay.Relay`, which can go silent.
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from relayd_client._connection import _CHANNEL_OPTIONS

from relayd import server
from relayd.config import Settings
from tests._daemon import async_wait_until
from tests._grpc_relay import ACK, GOAWAY, PING, Relay
from tests.unit._pools import unit_arena

pytestmark = pytest.mark.timeout(60)

KEEPALIVE_MS = 1000
KEEPALIVE_TIMEOUT_MS = 1000
# A ping after KEEPALIVE_MS of silence, then KEEPALIVE_TIMEOUT_MS for its answer;
# plus slack for a busy host. gRPC's own ping timeout is a minute.
DROPPED_WITHIN = (KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS) / 1000 + 5.0
CALL_BOUND = 10.0


async def until(predicate: Callable[[], Any], what: str, timeout: float = CALL_BOUND) -> None:
    await async_wait_until(predicate, timeout, what)


@asynccontextmanager
async def served(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Relay, Any]]:
    """The Relay server's options and health service on a Unix socket, a relay to
    it, and a client's health Watch through the relay, once it is SERVING."""
    monkeypatch.setattr(server, "GRPC_KEEPALIVE_MS", KEEPALIVE_MS)
    monkeypatch.setattr(server, "GRPC_KEEPALIVE_TIMEOUT_MS", KEEPALIVE_TIMEOUT_MS)
    socket = tmp_path / "relayd.sock"
    with unit_arena(4) as arena:
        grpc_server = grpc.aio.server(options=server.grpc_server_options(Settings(), arena))
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), grpc_server)
        grpc_server.add_insecure_port(f"unix:{socket}")
        await grpc_server.start()
        relay = Relay(f"unix:{socket}")
        channel = grpc.aio.insecure_channel(await relay.start(), options=_CHANNEL_OPTIONS)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        try:
            first = await asyncio.wait_for(watch.read(), CALL_BOUND)
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            yield relay, watch
        finally:
            watch.cancel()
            await relay.close()
            await asyncio.wait_for(channel.close(), CALL_BOUND)
            await grpc_server.stop(0)


def test_a_silent_client_is_dropped_within_the_keepalive_time_and_timeout(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        async with served(tmp_path, monkeypatch) as (relay, _):
            relay.silent = True  # the client answers nothing more
            await until(
                relay.server_closed.is_set,
                "the server to drop the silent client's connection",
                DROPPED_WITHIN,
            )

    asyncio.run(asyncio.wait_for(main(), 50))


def test_a_live_client_idle_on_a_call_keeps_its_connection_through_the_servers_pings(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's channel sets no keepalive of its own; it answers the server's
    pings, and nothing it sends makes the server end the connection (a GOAWAY,
    too_many_pings among them)."""

    async def main() -> None:
        async with served(tmp_path, monkeypatch) as (relay, watch):
            pings = 4
            await until(
                lambda: relay.count("up", PING, ACK) >= pings or watch.done(),
                f"the client to answer {pings} of the server's pings",
                pings * DROPPED_WITHIN,
            )
            assert relay.count("down", GOAWAY) == 0, "the server ended the client's connection"
            assert not watch.done() and not relay.server_closed.is_set()

    asyncio.run(asyncio.wait_for(main(), 50))
