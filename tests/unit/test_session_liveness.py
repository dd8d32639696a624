"""The session channel's watch over a silent daemon, against a scripted daemon end.

A real Unix socket; the far end binds the channel as a daemon would (BOUND,
saying it answers probes or, as an older daemon, not) and then does what each
test scripts: answer a probe, say something else, or nothing. The keepalive is
shortened; ``test_session_keepalive.py`` runs the same against ``relayd serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import relayd_client.wire.keepalive
from relayd_client._session import SessionChannel
from relayd_client.wire.errors import DaemonUnavailableError
from relayd_client.wire.framing import LENGTH_BYTES, decode_frame, encode_frame, frame_length
from relayd_client.wire.proto import relay_pb2 as pb

from tests._daemon import async_wait_until

pytestmark = pytest.mark.timeout(30)

KEEPALIVE_MS = 100
KEEPALIVE_TIMEOUT_MS = 100
# Well past a probe and its answer's deadline, on a busy host.
NOTICED_WITHIN = (KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS) / 1000 + 2.0
# Several keepalive periods: a watch that misbehaves shows within them.
SPELL = 6 * KEEPALIVE_MS / 1000
LONG = 30.0  # a call's timeout no test waits out


@pytest.fixture(autouse=True)
def _short_keepalive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relayd_client.wire.keepalive, "KEEPALIVE_MS", KEEPALIVE_MS)
    monkeypatch.setattr(relayd_client.wire.keepalive, "KEEPALIVE_TIMEOUT_MS", KEEPALIVE_TIMEOUT_MS)


class FarEnd:
    """The daemon's end: every frame the channel sent after its Bind, and a way back.

    ``on_probe``: what a probe gets ("answer", "other": some other frame, or
    "nothing").
    """

    def __init__(self, answers_probes: bool, on_probe: str) -> None:
        self.answers_probes = answers_probes
        self.on_probe = on_probe
        self.frames: list[pb.SessionFrame] = []
        self.writer: asyncio.StreamWriter | None = None

    def probes(self) -> int:
        return sum(f.probe for f in self.frames)

    def takes(self) -> list[pb.KeyedTake]:
        return [t for f in self.frames for t in f.keyed_take]

    def send(self, frame: pb.SessionFrame) -> None:
        assert self.writer is not None
        self.writer.write(encode_frame(frame))

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await self._read(reader)
        writer.close()  # hang up at the channel's end, as the daemon does

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while True:
            head = await reader.readexactly(LENGTH_BYTES)
            frame = decode_frame(await reader.readexactly(frame_length(head)))
            if frame.HasField("bind"):
                bound = pb.Event(kind=pb.EVENT_KIND_BOUND, message="socket")
                bound.answers_probes = self.answers_probes
                self.send(pb.SessionFrame(event=[bound]))
                continue
            self.frames.append(frame)
            if frame.probe and self.on_probe == "answer":
                self.send(pb.SessionFrame(probe_answer=True))
            elif frame.probe and self.on_probe == "other":
                event = pb.Event(kind=pb.EVENT_KIND_REGISTRY, registry_version=1)
                self.send(pb.SessionFrame(event=[event]))


@contextlib.asynccontextmanager
async def bound(
    answers_probes: bool = True, on_probe: str = "answer"
) -> AsyncIterator[tuple[SessionChannel, FarEnd, list[str]]]:
    """A channel connected and bound to a far end; the list counts its losses."""
    far = FarEnd(answers_probes, on_probe)
    lost: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "relayd.sock.session")
        server = await asyncio.start_unix_server(far.serve, path)
        channel = SessionChannel(lambda f: None, lambda: lost.append("lost"))
        try:
            await channel.connect(path, "s1", b"token", 5.0)
            yield channel, far, lost
        finally:
            await channel.close()
            server.close()
            if far.writer is not None:
                far.writer.close()
                with contextlib.suppress(ConnectionError):
                    await far.writer.wait_closed()
            await server.wait_closed()


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 20))


def take(channel: SessionChannel) -> asyncio.Future[bytes]:
    call = pb.KeyedTake(key="k", from_stage="a", to_stage="b", timeout_seconds=LONG)
    return asyncio.ensure_future(channel.keyed(call, LONG))


def answer(far: FarEnd, call: pb.KeyedTake) -> None:
    far.send(pb.SessionFrame(keyed_result=[pb.KeyedResult(call_id=call.call_id, data_ref=b"r")]))


def test_a_waiting_call_on_a_daemon_that_answers_no_probe_fails_and_ends_the_session() -> None:
    async def scenario() -> None:
        async with bound(on_probe="nothing") as (channel, far, lost):
            pending = take(channel)
            with pytest.raises(DaemonUnavailableError, match="liveness probe"):
                await asyncio.wait_for(pending, NOTICED_WITHIN)
            assert far.probes() == 1
            # Ended as if the daemon had hung up: the client re-attaches.
            await async_wait_until(lambda: lost, 5, "the session to end")
            assert lost == ["lost"] and channel.closed

    run(scenario)


def test_any_frame_from_the_daemon_answers_a_probe() -> None:
    """A daemon that says something else instead is alive all the same."""

    async def scenario() -> None:
        async with bound(on_probe="other") as (channel, far, lost):
            pending = take(channel)
            await async_wait_until(lambda: far.probes() >= 3, 5, "three probes")
            assert not pending.done() and not lost
            answer(far, far.takes()[0])
            assert await asyncio.wait_for(pending, 5) == b"r"

    run(scenario)


def test_an_older_daemon_is_never_probed() -> None:
    """One whose BOUND does not say it answers probes would ignore them: its calls
    wait for their answer as they always did, however long it is silent."""

    async def scenario() -> None:
        async with bound(answers_probes=False, on_probe="nothing") as (channel, far, lost):
            pending = take(channel)
            await async_wait_until(far.takes, 5, "the take")
            await asyncio.sleep(SPELL)  # silent for several keepalive periods
            assert not pending.done() and far.probes() == 0
            answer(far, far.takes()[0])
            assert await asyncio.wait_for(pending, 5) == b"r"
            assert not lost

    run(scenario)


def test_no_probe_while_no_call_waits() -> None:
    """Not before a call, nor after its answer came; only while it waited."""

    async def scenario() -> None:
        async with bound() as (channel, far, lost):
            await asyncio.sleep(SPELL)  # idle, and the daemon silent
            assert far.frames == []
            pending = take(channel)
            await async_wait_until(lambda: far.probes() >= 2, 5, "two probes")
            answer(far, far.takes()[0])
            assert await asyncio.wait_for(pending, 5) == b"r"
            probed = far.probes()
            await asyncio.sleep(SPELL)  # idle again
            assert far.probes() == probed and not lost

    run(scenario)
