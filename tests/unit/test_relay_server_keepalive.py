"""The Relay gRPC server drops a client that stopped answering (a stopped
process, say) within its keepalive time plus its keepalive timeout, while a
call of it is open; and it lets a live client's idle call be, the client's own
channel options and pings included; a client between calls sends no pings.

The server is built as the daemon builds it (``server.grpc_server_options``,
its keepalive shortened here so that a test can wait for it) and serves the
daemon's health service, whose Watch is a call that stays open; the client is a
real gRPC channel with the client's options, reaching it through
:class:`tests._grpc_relay.Relay`, which can go silent. How the client's own
pings find a daemon that froze is tests/integration/test_client_keepalive.py.
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from relayd_client import _connection

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
# A client between calls stays idle this many of its keepalive times.
IDLE_KEEPALIVES = 3


async def until(predicate: Callable[[], Any], what: str, timeout: float = CALL_BOUND) -> None:
    await async_wait_until(predicate, timeout, what)


@asynccontextmanager
async def serving(
    tmp_path: pathlib.Path, extra_options: Sequence[tuple[str, int]] = ()
) -> AsyncIterator[tuple[Relay, grpc.aio.Channel]]:
    """The Relay server's options and health service on a Unix socket, a relay to
    it, and a channel with the client's options (and ``extra_options``) through it."""
    socket = tmp_path / "relayd.sock"
    with unit_arena(4) as arena:
        grpc_server = grpc.aio.server(options=server.grpc_server_options(Settings(), arena))
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), grpc_server)
        grpc_server.add_insecure_port(f"unix:{socket}")
        await grpc_server.start()
        relay = Relay(f"unix:{socket}")
        options = [*_connection.channel_options(), *extra_options]
        channel = grpc.aio.insecure_channel(await relay.start(), options=options)
        try:
            yield relay, channel
        finally:
            await relay.close()
            await asyncio.wait_for(channel.close(), CALL_BOUND)
            await grpc_server.stop(0)


@asynccontextmanager
async def served(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Relay, Any]]:
    """:func:`serving`, the server's keepalive shortened, and a client's health
    Watch through the relay, once it is SERVING."""
    monkeypatch.setattr(server, "GRPC_KEEPALIVE_MS", KEEPALIVE_MS)
    monkeypatch.setattr(server, "GRPC_KEEPALIVE_TIMEOUT_MS", KEEPALIVE_TIMEOUT_MS)
    async with serving(tmp_path) as (relay, channel):
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        try:
            first = await asyncio.wait_for(watch.read(), CALL_BOUND)
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            yield relay, watch
        finally:
            watch.cancel()


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
    """The client answers the server's pings, and nothing it sends makes the
    server end the connection (a GOAWAY, too_many_pings among them). Its own
    keepalive is the client's (longer): the server's pings keep it unsent."""

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


def test_a_client_between_calls_sends_no_pings_and_keeps_its_connection(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Idle for several of its keepalive times with no call open, the client sends
    no ping (the server takes a ping on a connection without calls for abuse, and
    at the third ends the connection: GOAWAY too_many_pings); its next call goes
    out on the same connection. gRPC's bandwidth probes are pings too: they are
    off here, so that every ping the relay sees is a keepalive ping."""
    monkeypatch.setattr(_connection, "KEEPALIVE_MS", KEEPALIVE_MS)
    monkeypatch.setattr(_connection, "KEEPALIVE_TIMEOUT_MS", KEEPALIVE_TIMEOUT_MS)
    monkeypatch.setattr(server, "GRPC_CLIENT_PING_MIN_MS", KEEPALIVE_MS // 2)
    check = health_pb2.HealthCheckRequest()
    serving_now = health_pb2.HealthCheckResponse.SERVING

    async def main() -> None:
        async with serving(tmp_path, [("grpc.http2.bdp_probe", 0)]) as (relay, channel):
            stub = health_pb2_grpc.HealthStub(channel)
            assert (await asyncio.wait_for(stub.Check(check), CALL_BOUND)).status == serving_now
            # The keepalive's own pace: a client that pinged between calls would
            # have sent a ping a second by now.
            await asyncio.sleep(IDLE_KEEPALIVES * KEEPALIVE_MS / 1000)
            assert relay.count("up", PING) == 0, "the client pinged with no call open"
            assert (await asyncio.wait_for(stub.Check(check), CALL_BOUND)).status == serving_now
            assert relay.count("down", GOAWAY) == 0, "the server ended the client's connection"
            assert not relay.server_closed.is_set()

    asyncio.run(asyncio.wait_for(main(), 50))


def test_the_server_takes_the_clients_keepalive_pings() -> None:
    """The server permits pings at half the pace of the client's keepalive (its
    timer may fire a little early), and none between calls, when the client
    sends none."""
    with unit_arena(4) as arena:
        served = dict(server.grpc_server_options(Settings(), arena))
    client = dict(_connection.channel_options())
    permitted = served["grpc.http2.min_ping_interval_without_data_ms"]
    assert 2 * permitted <= client["grpc.keepalive_time_ms"]
    assert served.get("grpc.keepalive_permit_without_calls", 0) == 0
    assert client["grpc.keepalive_permit_without_calls"] == 0
