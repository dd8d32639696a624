"""The client's bind handshake on a socketpair: what the daemon's answer may carry."""

from __future__ import annotations

import array
import asyncio
import os
import socket
from collections.abc import Callable

import pytest
from relayd_client._bind import bind_session, map_rings
from relayd_client.wire.errors import DaemonUnavailableError, PermissionDeniedError
from relayd_client.wire.framing import FRAME_LENGTH, encode_frame
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.rings import IdRing

BOUND = pb.SessionFrame(event=[pb.Event(kind=pb.EVENT_KIND_BOUND, message="shm")])


def _answered(answer: Callable[[socket.socket], None]) -> tuple[pb.SessionFrame, list[int]]:
    """Bind against a daemon end that reads the Bind, then runs ``answer``."""

    async def main() -> tuple[pb.SessionFrame, list[int]]:
        client, daemon = socket.socketpair()
        client.setblocking(False)
        daemon.settimeout(5)  # a bind that never sends fails the test, not hangs it
        with client, daemon:
            task = asyncio.ensure_future(
                bind_session(asyncio.get_running_loop(), client, pb.Bind(freed_ring=True))
            )
            await asyncio.sleep(0)
            (n,) = FRAME_LENGTH.unpack(daemon.recv(FRAME_LENGTH.size))
            assert pb.SessionFrame.FromString(daemon.recv(n)).bind.freed_ring
            answer(daemon)
            return await asyncio.wait_for(task, 5)

    return asyncio.run(main())


def _answered_with(fds: list[int]) -> list[int]:
    def answer(daemon: socket.socket) -> None:
        data = encode_frame(BOUND) + encode_frame(pb.SessionFrame())  # and a frame after it
        daemon.sendmsg(
            [data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        )

    try:
        frame, got = _answered(answer)
    finally:
        for fd in fds:
            os.close(fd)
    assert frame.event[0].kind == pb.EVENT_KIND_BOUND and len(got) == len(fds)
    return got


def test_the_ring_descriptors_survive_and_map_in_order() -> None:
    freed, freed_fd = IdRing.create("relayd-freed")
    released, released_fd = IdRing.create("relayd-release")
    writer, reader = map_rings(_answered_with([freed_fd, released_fd]))
    assert writer is not None and reader is not None
    # The first is the daemon's Freed ring, the second the client's Release ring.
    assert freed.push(42) and writer.take() == [42]
    assert reader.push(7) and released.take() == [7]
    for ring in (writer, reader, freed, released):
        ring.close()


def test_a_daemon_that_sends_one_ring_gets_releases_by_frame() -> None:
    freed, fd = IdRing.create("relayd-freed")
    writer, reader = map_rings(_answered_with([fd]))
    assert writer is not None and reader is None
    assert freed.push(42) and writer.take() == [42]
    writer.close()
    freed.close()


def test_an_answer_without_a_descriptor_means_frames() -> None:
    _, fds = _answered(lambda daemon: daemon.sendall(encode_frame(BOUND)))
    assert fds == [] and map_rings(fds) == (None, None)


def test_a_refusal_is_the_daemons_error() -> None:
    refusal = pb.SessionFrame(
        event=[
            pb.Event(
                kind=pb.EVENT_KIND_ERROR,
                code=pb.ERROR_CODE_PERMISSION_DENIED,
                message="uid 7 is not allowed",
            )
        ]
    )
    with pytest.raises(PermissionDeniedError, match="uid 7"):
        _answered(lambda daemon: daemon.sendall(encode_frame(refusal)))


def test_a_malformed_or_missing_answer_is_daemon_unavailable() -> None:
    with pytest.raises(DaemonUnavailableError, match="malformed"):
        _answered(lambda daemon: daemon.sendall(FRAME_LENGTH.pack(3) + b"\xff\xff\xff"))
    with pytest.raises(ConnectionError):
        _answered(lambda daemon: daemon.shutdown(socket.SHUT_WR))
