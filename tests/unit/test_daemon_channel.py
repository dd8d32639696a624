"""The client's gRPC channel to the daemon: what it shares, and when it is renewed.

A channel to the daemon never inherits another channel's failed connect.

The client reaches the daemon's socket through ``/proc/self/fd/N`` (see
``wire.peercred.PinnedSocket``), and N is reused: a re-attach closes the old
channel and descriptor and opens new ones, which the kernel numbers alike. By
default gRPC shares subchannels process-wide by target and options, so the
new channel took over the old one's subchannel, failed connect and back-off
included, and the re-attach's Attach failed with the old "connect failed ...
No such file or directory" although the socket answered. The client's channel
options keep each channel's subchannels to itself.

A real gRPC server on a Unix socket, real channels with the client's options;
the first channel's connect fails because its descriptor is closed, the second
one's descriptor has the same number and leads to the live socket. A closed
channel's subchannel outlives it for a moment, now and then: the first channel
stays open here so that the second one meets it every time.

A call that got no answer (gRPC's own UNAVAILABLE) renews the channel; one
the daemon answered with a relayd error, UNAVAILABLE too (draining, a peer
gone), does not. A call still on the old channel ends by itself, answered,
not cancelled. How the renewal serves the call after a frozen daemon runs
again is tests/integration/test_client_keepalive.py.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import pathlib

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from relayd_client import _connection
from relayd_client.wire import peercred
from relayd_client.wire.errors import ErrorCode
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.status import ERROR_CODE_KEY, unanswered

pytestmark = pytest.mark.timeout(60)

CALL_BOUND = 10.0
# Descriptors from here up are left alone by gRPC and the interpreter, which
# take the lowest free ones: the test can reuse a number of its choosing.
HIGH_FD = 512


def _pin(path: pathlib.Path, number: int | None = None) -> int:
    """``path`` open O_PATH at descriptor ``number`` (else the lowest free from HIGH_FD)."""
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        if number is None:
            return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, HIGH_FD)
        os.dup2(fd, number)
        return number
    finally:
        os.close(fd)


async def _check(channel: grpc.aio.Channel) -> grpc.StatusCode:
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=CALL_BOUND)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _channel(target: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target, options=_connection.channel_options())


async def _reuse(tmp_path: pathlib.Path) -> None:
    socket = tmp_path / "relayd.sock"
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_insecure_port(f"unix:{socket}")
    await server.start()
    try:
        fd = _pin(socket)
        target = f"unix:/proc/self/fd/{fd}"
        os.close(fd)  # the old session's descriptor, gone: its channel's connect fails
        async with _channel(target) as old:
            assert await _check(old) is grpc.StatusCode.UNAVAILABLE
            _pin(socket, fd)  # the re-attach's descriptor, with the same number
            try:
                async with _channel(target) as new:
                    assert await _check(new) is grpc.StatusCode.OK
            finally:
                os.close(fd)
    finally:
        await server.stop(None)


def test_a_channel_to_a_reused_descriptor_connects_afresh(tmp_path: pathlib.Path) -> None:
    asyncio.run(asyncio.wait_for(_reuse(tmp_path), 4 * CALL_BOUND))


def _rpc_error(code: grpc.StatusCode, relayd_code: ErrorCode | None = None) -> grpc.RpcError:
    trailing = grpc.aio.Metadata()
    if relayd_code is not None:
        trailing.add(ERROR_CODE_KEY, str(int(relayd_code)))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, "details")


def test_only_a_call_the_daemon_did_not_answer_counts_as_unanswered() -> None:
    assert unanswered(_rpc_error(grpc.StatusCode.UNAVAILABLE))
    assert not unanswered(_rpc_error(grpc.StatusCode.UNAVAILABLE, ErrorCode.DRAINING))
    assert not unanswered(_rpc_error(grpc.StatusCode.UNAVAILABLE, ErrorCode.PEER_UNAVAILABLE))
    assert not unanswered(_rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED))
    assert not unanswered(_rpc_error(grpc.StatusCode.CANCELLED))


async def _renewal(tmp_path: pathlib.Path) -> None:
    socket = tmp_path / "relayd.sock"
    arrived, answer = asyncio.Event(), asyncio.Event()

    async def status(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        arrived.set()
        await answer.wait()
        return pb.StatusResponse(node_id="here").SerializeToString()

    server = grpc.aio.server()
    handlers = {"Status": grpc.unary_unary_rpc_method_handler(status)}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("relayd.v1.Relay", handlers),)
    )
    server.add_insecure_port(f"unix:{socket}")
    await server.start()
    # The parts of a Connection that the renewal uses, on a real pinned socket.
    conn = _connection.Connection.__new__(_connection.Connection)
    conn.timeout = CALL_BOUND
    conn._retired = set()
    conn._pinned = peercred.PinnedSocket(str(socket), frozenset({os.getuid()}), CALL_BOUND)
    try:
        old = conn._open_channel(conn._pinned)
        waiting = asyncio.ensure_future(old.Status(pb.StatusRequest(), timeout=CALL_BOUND))
        await asyncio.wait_for(arrived.wait(), CALL_BOUND)
        conn._renew_channel(old)
        assert conn.stub is not old
        conn._renew_channel(old)  # a second failed call of the old channel: renewed already
        assert len(conn._retired) == 1
        answer.set()
        assert (await asyncio.wait_for(waiting, CALL_BOUND)).node_id == "here"
        await asyncio.wait_for(asyncio.gather(*conn._retired), CALL_BOUND)
        assert (await conn.stub.Status(pb.StatusRequest(), timeout=CALL_BOUND)).node_id == "here"
        assert conn._channel is not None
        await conn._channel.close()
    finally:
        conn._pinned.close()
        await server.stop(None)


def test_a_renewed_channel_lets_the_calls_still_on_it_end_answered(tmp_path: pathlib.Path) -> None:
    asyncio.run(asyncio.wait_for(_renewal(tmp_path), 4 * CALL_BOUND))
