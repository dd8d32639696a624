"""The client's session channel: when batched notices reach the socket.

A real socket pair stands in for the daemon; frames are read back and decoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from relayd_client._session import LINGER_MAX_NOTICES, SessionChannel
from relayd_client.wire.framing import (
    LENGTH_BYTES,
    NOTICE_LINGER_MAX_BYTES,
    decode_frame,
    frame_length,
)
from relayd_client.wire.proto import relay_pb2 as pb

pytestmark = pytest.mark.timeout(30)

LONG = 60.0  # a linger no test waits out: a frame that needs it is a failure


class Daemon:
    """The far end of the socket: decodes what the channel wrote."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def ready(self) -> list[pb.SessionFrame]:
        """Frames already written, without waiting."""
        try:
            while chunk := self.sock.recv(1 << 20):
                self.buf += chunk
        except BlockingIOError:
            pass
        frames = []
        while len(self.buf) >= LENGTH_BYTES:
            end = LENGTH_BYTES + frame_length(self.buf)
            frames.append(decode_frame(self.buf[LENGTH_BYTES:end]))
            self.buf = self.buf[end:]
        return frames

    async def next(self, timeout: float = 5.0) -> pb.SessionFrame:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not (frames := self.ready()):
            if loop.time() > deadline:
                raise AssertionError("no frame within the deadline")
            fut = loop.create_future()
            loop.add_reader(self.sock.fileno(), fut.set_result, None)
            try:
                await asyncio.wait_for(fut, max(deadline - loop.time(), 0.0))
            except TimeoutError:
                pass
            finally:
                loop.remove_reader(self.sock.fileno())
        assert len(frames) == 1, frames
        return frames[0]


@contextlib.asynccontextmanager
async def connected() -> AsyncIterator[tuple[SessionChannel, Daemon]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b.setblocking(False)
    _, writer = await asyncio.open_unix_connection(sock=a)
    channel = SessionChannel(lambda f: None, lambda: None)
    channel._writer = writer  # the connected half of connect(), without the bind handshake
    try:
        yield channel, Daemon(b)
    finally:
        channel.closed = True
        writer.close()
        b.close()


def run(scenario: Callable[[SessionChannel, Daemon], Awaitable[None]]) -> None:
    async def main() -> None:
        async with connected() as (channel, daemon):
            await asyncio.wait_for(scenario(channel, daemon), 10)

    asyncio.run(main())


async def turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def release(channel: SessionChannel, lease_id: int) -> None:
    channel.pending.release.append(pb.Release(lease_id=lease_id, generation=lease_id))


def busy(channel: SessionChannel, daemon: Daemon) -> None:
    """A frame just went out: the channel is busy, so lingering notices linger."""
    channel.pending.report.append(pb.TransferReport(transport=pb.TRANSPORT_SHM, count=1))
    channel.mark(flush=True)
    assert len(daemon.ready()) == 1


def test_a_release_lingers_past_the_turn_then_goes_out() -> None:
    async def scenario(channel: SessionChannel, daemon: Daemon) -> None:
        busy(channel, daemon)
        release(channel, 1)
        channel.mark(linger=0.5, holds=4096)
        release(channel, 2)
        channel.mark(linger=0.5, holds=4096)
        await turns()
        assert daemon.ready() == []
        frame = await daemon.next()
        assert [r.lease_id for r in frame.release] == [1, 2]

    run(scenario)


def test_a_sooner_notice_takes_the_lingering_ones_along() -> None:
    async def scenario(channel: SessionChannel, daemon: Daemon) -> None:
        busy(channel, daemon)
        release(channel, 7)
        channel.mark(linger=LONG, holds=1)
        channel.pending.publish.append(pb.Publish(lease_id=8, nbytes=1))
        channel.mark()
        await turns()
        (frame,) = daemon.ready()
        assert [r.lease_id for r in frame.release] == [7]
        assert [p.lease_id for p in frame.publish] == [8]
        assert channel._lingering is None  # the timer went with the frame

    run(scenario)


def test_lingering_releases_go_at_once_when_they_hold_enough_bytes() -> None:
    async def scenario(channel: SessionChannel, daemon: Daemon) -> None:
        busy(channel, daemon)
        release(channel, 1)
        channel.mark(linger=LONG, holds=NOTICE_LINGER_MAX_BYTES // 2)
        await turns()
        assert daemon.ready() == []
        release(channel, 2)
        channel.mark(linger=LONG, holds=NOTICE_LINGER_MAX_BYTES // 2)
        frame = await daemon.next()
        assert [r.lease_id for r in frame.release] == [1, 2]

    run(scenario)


def test_a_4_mib_transfers_notice_lingers_for_company() -> None:
    """Each frame a client sends wakes the daemon; a whole frame per 4 MiB transfer
    was most of the daemon's CPU for it. Two of them share one frame."""

    async def scenario(channel: SessionChannel, daemon: Daemon) -> None:
        busy(channel, daemon)
        release(channel, 1)
        channel.mark(linger=LONG, holds=4 << 20)
        await turns()
        assert daemon.ready() == []
        release(channel, 2)
        channel.mark(linger=LONG, holds=4 << 20)
        frame = await daemon.next()
        assert [r.lease_id for r in frame.release] == [1, 2]

    run(scenario)


def test_lingering_releases_go_at_once_when_there_are_enough_of_them() -> None:
    async def scenario(channel: SessionChannel, daemon: Daemon) -> None:
        busy(channel, daemon)
        for lease_id in range(1, LINGER_MAX_NOTICES + 1):
            release(channel, lease_id)
            channel.mark(linger=LONG)
        frame = await daemon.next()
        assert len(frame.release) == LINGER_MAX_NOTICES
        # The count starts again: one more lingers.
        release(channel, 0)
        channel.mark(linger=LONG)
        await turns()
        assert daemon.ready() == []

    run(scenario)


def test_flush_true_writes_before_returning() -> None:
    async def scenario(channel: SessionChannel, daemon: Daemon) -> None:
        busy(channel, daemon)
        release(channel, 3)
        channel.mark(linger=LONG)
        channel.pending.claim.append(pb.Claim(lease_id=4, generation=4))
        channel.mark(flush=True)
        (frame,) = daemon.ready()
        assert [r.lease_id for r in frame.release] == [3]
        assert [c.lease_id for c in frame.claim] == [4]

    run(scenario)


def test_a_lone_notice_on_an_idle_channel_goes_at_the_end_of_the_turn() -> None:
    # Nothing would join it, and a timer is one more wakeup of this process.
    async def scenario(channel: SessionChannel, daemon: Daemon) -> None:
        release(channel, 5)
        channel.mark(linger=LONG)
        await turns()
        (frame,) = daemon.ready()
        assert [r.lease_id for r in frame.release] == [5]
        # It made the channel busy: the next one lingers.
        release(channel, 6)
        channel.mark(linger=LONG)
        await turns()
        assert daemon.ready() == []

    run(scenario)


def test_a_fetch_its_caller_answered_returns_at_once_and_drops_the_daemons_answer() -> None:
    """A reader told by an announcement where the push landed does not wait for
    the daemon's answer to the FetchCall that crossed it."""

    async def scenario(channel: SessionChannel, daemon: Daemon) -> None:
        answer: asyncio.Future[pb.FetchResponse] = asyncio.get_running_loop().create_future()
        fetch = asyncio.ensure_future(channel.fetch(b"the ref", 5.0, answer))
        (call,) = (await daemon.next()).fetch
        assert call.data_ref == b"the ref"
        early = pb.FetchResponse(node_id="node-b", daemon_epoch="eb")
        answer.set_result(early)
        assert await fetch == early
        assert not channel._calls  # the call is over: the daemon's answer finds nothing
        late = pb.FetchResponse(node_id="the daemon's answer")
        channel._answer(
            pb.SessionFrame(fetched=[pb.FetchResult(call_id=call.call_id, response=late)])
        )
        assert answer.result() == early

    run(scenario)
