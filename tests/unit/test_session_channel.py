"""The client's session channel: when batched notices reach the socket, and
how the daemon's frames are read.

A real socket pair stands in for the daemon; frames are read back and decoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from relayd_client._session import LINGER_MAX_NOTICES, SessionChannel, _Frames
from relayd_client.wire.errors import DaemonUnavailableError
from relayd_client.wire.framing import (
    FRAME_LENGTH,
    LENGTH_BYTES,
    MAX_FRAME,
    NOTICE_LINGER_MAX_BYTES,
    decode_frame,
    encode_frame,
    frame_length,
)
from relayd_client.wire.proto import relay_pb2 as pb

from tests._daemon import async_wait_until

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
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_unix_connection(asyncio.Protocol, sock=a)
    channel = SessionChannel(lambda f: None, lambda: None)
    # The connected half of connect(), without the bind handshake.
    channel._transport, channel._loop = transport, loop
    try:
        yield channel, Daemon(b)
    finally:
        channel.closed = True
        if channel._raw is not None:  # a blocking caller's descriptor of the socket
            channel._raw.close()
        transport.close()
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


async def half_the_cap(caller: str, channel: SessionChannel) -> None:
    """Mark the pending notice lingering, holding half of NOTICE_LINGER_MAX_BYTES:
    from the event loop (``caller`` "loop") or from a blocking client's thread."""
    holds = NOTICE_LINGER_MAX_BYTES // 2
    if caller == "loop":
        channel.mark(linger=LONG, holds=holds)
    else:
        await asyncio.to_thread(channel.mark, linger=LONG, holds=holds)


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


@pytest.mark.parametrize("caller", ["loop", "thread"])
def test_lingering_releases_go_at_once_when_they_hold_enough_bytes(caller: str) -> None:
    """From the event loop or from a blocking client's thread alike. (To an older
    daemon, a lease of ``PROMPT_NOTICE_BYTES`` or more is not marked lingering at
    all: see test_prompt_notices.)"""

    async def scenario(channel: SessionChannel, daemon: Daemon) -> None:
        busy(channel, daemon)
        release(channel, 1)
        await half_the_cap(caller, channel)
        await turns()
        assert daemon.ready() == []
        release(channel, 2)
        await half_the_cap(caller, channel)
        frame = await daemon.next()
        assert [r.lease_id for r in frame.release] == [1, 2]

    run(scenario)


@pytest.mark.parametrize("caller", ["loop", "thread"])
def test_bytes_a_writer_took_back_no_longer_hold_a_lingering_frame(caller: str) -> None:
    """A writer takes a run back on its reader's read mark while the lease's
    Publish still lingers: those bytes are held back from nobody, so they do
    not count toward the cap; bytes counted in a frame that went already are
    not taken off the next one's."""
    holds = NOTICE_LINGER_MAX_BYTES // 2

    async def scenario(channel: SessionChannel, daemon: Daemon) -> None:
        busy(channel, daemon)
        for lease_id in (1, 2, 3):
            channel.pending.publish.append(pb.Publish(lease_id=lease_id, nbytes=holds))
            frame = channel.pending
            await half_the_cap(caller, channel)
            channel.taken_back(frame, holds)  # its reader marked it; the writer reuses it
        await turns()
        assert daemon.ready() == []  # three times half the cap, all taken back
        sent = channel.pending
        channel.mark(flush=True)
        assert [p.lease_id for p in (await daemon.next()).publish] == [1, 2, 3]
        channel.pending.publish.append(pb.Publish(lease_id=4, nbytes=holds))
        await half_the_cap(caller, channel)
        channel.taken_back(sent, holds)  # counted in the frame that went: nothing to take off
        channel.pending.publish.append(pb.Publish(lease_id=5, nbytes=holds))
        await half_the_cap(caller, channel)
        assert [p.lease_id for p in (await daemon.next()).publish] == [4, 5]

    run(scenario)


def test_a_linger_timer_that_outlived_a_frame_sent_from_a_thread_lingers_from_that_send() -> None:
    """A blocking caller's thread writes a due frame itself and cannot cancel the
    loop's timer: when that timer comes, what came since waits out its own linger
    instead of going at once as a frame of its own (one more daemon wake-up)."""

    async def scenario(channel: SessionChannel, daemon: Daemon) -> None:
        busy(channel, daemon)
        release(channel, 1)
        await asyncio.to_thread(channel.mark, linger=LONG, holds=1)
        await async_wait_until(lambda: channel._lingering is not None, 5, "timer armed")
        timer = channel._lingering
        await asyncio.to_thread(channel.mark, flush=True)  # a sooner notice, from the thread
        assert [r.lease_id for r in (await daemon.next()).release] == [1]
        assert channel._lingering is timer  # still armed
        release(channel, 2)
        await asyncio.to_thread(channel.mark, linger=LONG, holds=1)
        assert timer is not None
        timer.cancel()
        channel._linger_due()  # the timer comes
        await turns()
        assert daemon.ready() == []
        again = channel._lingering
        assert again is not None and again is not timer
        assert again.when() >= channel._sent_at + LONG - 1.0  # a linger from the send
        channel.mark(flush=True)
        assert [r.lease_id for r in (await daemon.next()).release] == [2]

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


# -- frames in --------------------------------------------------------------------


def _event(message: str) -> pb.SessionFrame:
    return pb.SessionFrame(event=[pb.Event(kind=pb.EVENT_KIND_BOUND, message=message)])


@contextlib.asynccontextmanager
async def reading(
    on_frame: Callable[[pb.SessionFrame], None],
) -> AsyncIterator[tuple[SessionChannel, socket.socket, list[str]]]:
    """A channel reading what the far end (yielded) writes; the list counts its losses."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    lost: list[str] = []
    channel = SessionChannel(on_frame, lambda: lost.append("lost"))
    loop = asyncio.get_running_loop()
    channel._ended = loop.create_future()
    transport, _ = await loop.create_unix_connection(lambda: _Frames(channel), sock=a)
    channel._transport = transport
    try:
        yield channel, b, lost
    finally:
        transport.close()
        b.close()


def test_frames_are_handled_whole_and_in_order_however_the_bytes_arrive() -> None:
    async def main() -> None:
        got: list[str] = []
        three = asyncio.Event()

        def on_frame(f: pb.SessionFrame) -> None:
            got.append(f.event[0].message)
            if len(got) == 3:
                three.set()

        async with reading(on_frame) as (channel, far, lost):
            frames = channel._transport.get_protocol() if channel._transport else None
            assert isinstance(frames, _Frames)
            first, second, third = (encode_frame(_event(m)) for m in ("one", "two", "three" * 100))
            far.sendall(first[:3])  # not even a whole length prefix
            await async_wait_until(lambda: len(frames.buf) == 3, 5, "the prefix's 3 bytes")
            assert got == []
            # The rest of the first, the second and half the third, in one read.
            far.sendall(first[3:] + second + third[:100])
            await async_wait_until(lambda: len(got) == 2, 5, "the first two frames")
            assert bytes(frames.buf) == third[:100]
            far.sendall(third[100:])
            await asyncio.wait_for(three.wait(), 5)
            assert got == ["one", "two", "three" * 100]
            assert not lost

    asyncio.run(main())


def test_a_fetch_answer_resolves_in_the_read_that_brings_it() -> None:
    """No reader task between the socket and the caller: the answer is set while
    its frame is read, so the waiting get resumes in the next loop turn."""

    async def main() -> None:
        async with reading(lambda f: None) as (channel, _, _):
            fetch = asyncio.ensure_future(channel.fetch(b"ref", 5.0))
            await async_wait_until(lambda: channel._calls, 5, "the fetch call")
            (call_id,) = channel._calls
            answer = channel._calls[call_id]
            response = pb.FetchResponse(node_id="node-b")
            frame = pb.SessionFrame(fetched=[pb.FetchResult(call_id=call_id, response=response)])
            protocol = _Frames(channel)
            protocol.transport = channel._transport
            protocol.data_received(encode_frame(frame))
            assert answer.done()  # before the loop has run anything else
            assert (await fetch).node_id == "node-b"

    asyncio.run(main())


BAD_FRAMES = {
    "longer than any frame": FRAME_LENGTH.pack(MAX_FRAME + 1),
    "does not parse": FRAME_LENGTH.pack(3) + b"\xff\xff\xff",
}


@pytest.mark.parametrize("bad", [*BAD_FRAMES, "a handler that raises"])
def test_a_bad_frame_ends_the_session_once_and_fails_the_calls_in_flight(bad: str) -> None:
    async def main() -> None:
        handled: list[str] = []

        def on_frame(f: pb.SessionFrame) -> None:
            if f.event[0].message == "raise":
                raise ValueError("a bug in a handler")
            handled.append(f.event[0].message)

        async with reading(on_frame) as (channel, far, lost):
            fetch = asyncio.ensure_future(channel.fetch(b"ref", 5.0))
            await async_wait_until(lambda: channel._calls, 5, "the fetch call")
            poison = encode_frame(_event("raise")) if bad not in BAD_FRAMES else BAD_FRAMES[bad]
            far.sendall(encode_frame(_event("before")) + poison + encode_frame(_event("after")))
            with pytest.raises(DaemonUnavailableError, match="session closed"):
                await asyncio.wait_for(fetch, 5)
            assert channel._ended is not None
            await asyncio.wait_for(channel._ended, 5)
            assert handled == ["before"]  # nothing after the bad frame
            assert lost == ["lost"] and channel.closed
            with pytest.raises(BrokenPipeError):  # our end is closed: it reads nothing more
                far.sendall(encode_frame(_event("later")))

    asyncio.run(main())
