"""The notice channel between daemons holds its end against whoever connects.

A real listener on a loopback TCP port, real sockets dialling it: the honest
dialler's batches arrive in order; a wrong token, a peer not up here, a replayed
answer, an oversized or garbage frame, another node's notices, a silent
connection and a flood of unauthenticated ones are each closed, never handled,
and the listener goes on serving the honest peer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import struct
import types
from collections.abc import Awaitable, Callable, Iterator, Sequence

import pytest
from relayd_client.wire.framing import LENGTH_BYTES
from relayd_client.wire.proto import relay_pb2 as pb

from relayd import loops, peer_channel
from relayd.config import ConfigError, Settings
from relayd.peer_channel import (
    ACCEPTED,
    MAX_ATTACHED,
    MAX_FRAME,
    MAX_HELLO,
    MAX_PENDING,
    NONCE_BYTES,
    NoticeLink,
    NoticeListener,
    answer,
    frame,
)
from relayd.peer_links import PeerState
from relayd.peer_notices import PeerNotifier
from tests._daemon import async_wait_until, listener_reading
from tests._figures import count

TOKEN = b"0123456789abcdef-shared-peer-token"
NODE, EPOCH = "node-w", "epoch-w"
WAIT_S = 5.0


class Harness:
    """A listener that knows one peer (``up``), and what it handed on."""

    def __init__(self) -> None:
        self.up: set[tuple[str, str]] = {(NODE, EPOCH)}
        self.handled: list[pb.PeerNotices] = []
        self.attached: list[list[bytes]] = []  # each batch's attached bytes, copied
        self.places: list[memoryview] = []  # the last batch's, as placed
        self.placed = self.given_back = 0  # places handed out and given back
        self.short_places = False  # place one byte too few (a placer's bug)
        self.listener = NoticeListener(
            TOKEN,
            lambda node, epoch: (node, epoch) in self.up,
            self.handle,
            self.place,
            self.release,
        )
        self.port = 0
        self.links: list[NoticeLink] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self.port = await self.listener.start("127.0.0.1", 0)

    def handle(self, batch: pb.PeerNotices, attached: Sequence[memoryview]) -> None:
        self.handled.append(batch)
        self.attached.append([bytes(view) for view in attached])
        if attached:  # read into the places given, not copied from elsewhere
            assert len(attached) == len(self.places)
            assert all(got is placed for got, placed in zip(attached, self.places, strict=True))

    def place(self, batch: pb.PeerNotices) -> list[memoryview]:
        views = peer_channel.scratch(batch)
        if self.short_places:
            views = [view[:-1] for view in views]
        self.places = views
        self.placed += len(views)
        return views

    def release(self, views: Sequence[memoryview]) -> None:
        self.given_back += len(views)

    async def dial(
        self,
        node: str = NODE,
        epoch: str = EPOCH,
        token: bytes = TOKEN,
        stall_timeout: float = peer_channel.STALL_TIMEOUT_S,
    ) -> NoticeLink:
        link = await NoticeLink.open(
            "127.0.0.1", self.port, token, _hello(node, epoch), WAIT_S, stall_timeout
        )
        self.links.append(link)
        return link

    def reading(self, on: bool) -> None:
        listener_reading(self.listener, on)

    async def raw(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
        """A bare connection and the challenge it was sent."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writers.append(writer)
        (n,) = struct.unpack("<I", await reader.readexactly(4))
        assert n == NONCE_BYTES
        return reader, writer, await reader.readexactly(n)

    async def until(self, what: Callable[[], bool], why: str) -> None:
        await async_wait_until(what, WAIT_S, why)

    async def honest_batch_arrives(self, tag: int) -> None:
        """The listener still serves the honest peer (a fresh connection)."""
        link = await self.dial()
        before = len(self.handled)
        assert link.send(_batch(tag))
        await self.until(lambda: len(self.handled) > before, "the honest batch")
        assert self.handled[-1].landed[0].lease_id == tag
        link.close()


def _hello(node: str = NODE, epoch: str = EPOCH) -> pb.PeerNotices:
    """What a dialler says it is (signed in its answer)."""
    return pb.PeerNotices(node_id=node, daemon_epoch=epoch)


def _batch(
    lease_id: int, node: str = NODE, epoch: str = EPOCH, attached: Sequence[int] = ()
) -> pb.PeerNotices:
    """One Landed notice (``lease_id``), then one more per ``attached`` length."""
    n = pb.PeerNotices(node_id=node, daemon_epoch=epoch)
    n.landed.add(lease_id=lease_id, generation=lease_id, length=1)
    for k, nbytes in enumerate(attached):
        n.landed.add(lease_id=lease_id + k + 1, length=nbytes, attached=nbytes)
    return n


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def _closed(reader: asyncio.StreamReader) -> bool:
    """True once the listener has closed the connection (EOF or reset)."""
    try:
        async with asyncio.timeout(WAIT_S):
            return await reader.read(1 << 16) == b""
    except ConnectionError:
        return True


def run(body: Callable[[Harness], Awaitable[None]], loop: str = "asyncio") -> Harness:
    """``body`` against a fresh listener, on ``loop`` (``auto``: the daemon's own)."""

    async def main() -> Harness:
        h = Harness()
        await h.start()
        try:
            await body(h)
        finally:
            for link in h.links:
                link.close()
            for writer in h.writers:
                writer.transport.abort()
            await h.listener.close()
        return h

    with asyncio.Runner(loop_factory=loops.loop_factory(loop)) as runner:
        return runner.run(main())


@pytest.fixture(autouse=True)
def _short_hello(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(peer_channel, "HELLO_TIMEOUT_S", 0.3)
    yield


def test_an_honest_peers_batches_arrive_in_order() -> None:
    async def body(h: Harness) -> None:
        link = await h.dial()
        for i in range(1, 201):
            assert link.send(_batch(i))
        await h.until(lambda: len(h.handled) == 200, "200 batches")
        assert [b.landed[0].lease_id for b in h.handled] == list(range(1, 201))
        assert h.listener.refused == 0

    run(body)


def test_attached_bytes_reach_the_handler_with_their_batch_however_they_are_cut() -> None:
    sizes = (3, 70_000, 1)
    blobs = [bytes([k + 1]) * n for k, n in enumerate(sizes)]

    async def body(h: Harness) -> None:
        link = await h.dial()
        assert link.send(_batch(1, attached=sizes), blobs)
        assert link.send(_batch(9))
        await h.until(lambda: len(h.handled) == 2, "two batches")
        # The same bytes from a raw peer, in pieces that cut the frame and the data.
        reader, writer, nonce = await h.raw()
        writer.write(frame(answer(TOKEN, nonce, _hello())))
        assert await reader.readexactly(LENGTH_BYTES) == frame(ACCEPTED)
        wire = frame(_batch(1, attached=sizes).SerializeToString()) + b"".join(blobs)
        wire += frame(_batch(9).SerializeToString())
        for at in range(0, len(wire), 4093):
            writer.write(wire[at : at + 4093])
            await writer.drain()
        await h.until(lambda: len(h.handled) == 4, "the raw peer's two batches")
        for first, second in (h.attached[0:2], h.attached[2:4]):
            assert first == blobs and second == []
        assert [b.landed[0].lease_id for b in h.handled] == [1, 9, 1, 9]
        assert h.listener.refused == 0
        assert h.placed == h.given_back == 2 * len(sizes)

    run(body)


def test_a_large_push_is_read_in_large_reads_and_its_tail_and_the_next_batch_still_come(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While attached bytes arrive the listener asks the kernel for no wake-up before
    ATTACHED_READ_MIN of them are in, never for more than remain, and for every
    byte again once the batch is in: else a 5-byte tail, or the small batch after
    it, would never wake it."""
    asked: list[int] = []
    wake_at = peer_channel._Inbound.wake_at

    def recorded(self: peer_channel._Inbound, nbytes: int) -> None:
        asked.append(nbytes)
        wake_at(self, nbytes)

    monkeypatch.setattr(peer_channel._Inbound, "wake_at", recorded)
    sizes = (3 * peer_channel.ATTACHED_READ_MIN, 5)
    blobs = [bytes([k + 7]) * n for k, n in enumerate(sizes)]

    async def body(h: Harness) -> None:
        reader, writer, nonce = await h.raw()
        writer.write(frame(answer(TOKEN, nonce, _hello())))
        assert await reader.readexactly(LENGTH_BYTES) == frame(ACCEPTED)
        wire = frame(_batch(1, attached=sizes).SerializeToString()) + b"".join(blobs)
        for at in range(0, len(wire), 300_000):  # trickling in, as a busy link delivers
            writer.write(wire[at : at + 300_000])
            await writer.drain()
        await h.until(lambda: len(h.handled) == 1, "the large batch")
        writer.write(frame(_batch(9).SerializeToString()))
        await h.until(lambda: len(h.handled) == 2, "the small batch after it")
        assert h.attached[0] == blobs and h.attached[1] == []
        inbound = h.listener.by_node[NODE]
        assert inbound.transport is not None
        sock = inbound.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1

    run(body)
    assert max(asked) == peer_channel.ATTACHED_READ_MIN
    assert 1 < min(a for a in asked if a > 1) < peer_channel.ATTACHED_READ_MIN  # the tail
    assert asked[-1] == 1


# More than the kernel takes at once from a sender whose listener is not reading.
QUEUED = MAX_ATTACHED


@pytest.mark.parametrize("loop", ["asyncio", "auto"])
def test_attached_bytes_may_change_once_the_link_says_they_went(loop: str) -> None:
    """A sender hands over views of memory it overwrites as soon as it may (a
    writer's run, held until ``sent``): ``sent`` comes only once the kernel has
    taken the bytes, and each batch brings the bytes that were there when it
    was sent, also those that waited in the sender's queue."""
    batches = 3
    memory = bytearray(QUEUED)

    async def body(h: Harness) -> None:
        link = await h.dial()
        went: list[int] = []
        for k in range(batches):
            await h.until(lambda k=k: len(went) == k, "the last batch's bytes to go")
            memory[:] = bytes([k + 1]) * QUEUED
            if k == 0:
                h.reading(False)
            with memoryview(memory) as view:
                assert link.send(
                    _batch(10 * k, attached=(QUEUED,)), (view,), lambda k=k: went.append(k)
                )
            if k == 0:
                assert link.backlog > 0  # some of it waits in the sender's queue...
                assert not went  # ...so its memory may not change yet
                h.reading(True)
        await h.until(lambda: len(went) == batches, "every batch's bytes to go")
        assert went == list(range(batches))
        assert link.backlog == 0
        memory[:] = bytes(QUEUED)
        await h.until(lambda: len(h.handled) == batches, "every batch")
        assert [[_sha(blob) for blob in got] for got in h.attached] == [
            [_sha(bytes([k + 1]) * QUEUED)] for k in range(batches)
        ]

    run(body, loop)


def test_the_daemons_loop_sends_queued_attached_bytes_from_where_they_lie() -> None:
    """No copy on the daemon's loop: a change to the memory before ``sent``
    reaches the peer (the contract that makes a pushed run stay held until then)."""
    pytest.importorskip("uvloop")  # asyncio's transport copies what it queues (3.11)
    memory = bytearray(b"\x01" * QUEUED)

    async def body(h: Harness) -> None:
        link = await h.dial()
        h.reading(False)
        went: list[bool] = []
        with memoryview(memory) as view:
            assert link.send(_batch(1, attached=(QUEUED,)), (view,), lambda: went.append(True))
        assert link.backlog > 0 and not went
        memory[-1:] = b"\x02"  # still in the queue: read from here
        h.reading(True)
        await h.until(lambda: bool(h.handled) and bool(went), "the batch")
        assert h.attached[0][0][-1:] == b"\x02"

    run(body, "auto")


@pytest.mark.parametrize("loop", ["asyncio", "auto"])
def test_a_link_closed_with_bytes_queued_says_they_went(loop: str) -> None:
    """Closing the link ends the wait of whoever held memory for its queue."""

    async def body(h: Harness) -> None:
        link = await h.dial()
        h.reading(False)
        went: list[bool] = []
        assert link.send(_batch(1, attached=(QUEUED,)), (bytes(QUEUED),), lambda: went.append(True))
        assert link.backlog > 0 and not went
        link.close()
        await h.until(lambda: bool(went), "the closed link to let go of the bytes")
        assert went == [True]
        assert not link.alive
        assert not link.send(_batch(2), (), lambda: went.append(False))
        assert went == [True]

    run(body, loop)


@pytest.mark.parametrize("loop", ["asyncio", "auto"])
def test_a_link_whose_peer_stops_reading_is_dropped_after_the_stall_timeout(loop: str) -> None:
    """A listener that takes nothing more cannot keep a sender's memory for good:
    once its queue has not emptied for the stall timeout, the link goes and says so."""

    async def body(h: Harness) -> None:
        link = await h.dial(stall_timeout=0.3)
        h.reading(False)
        went: list[bool] = []
        assert link.send(_batch(1, attached=(QUEUED,)), (bytes(QUEUED),), lambda: went.append(True))
        assert link.backlog > 0 and not went
        await h.until(lambda: bool(went), "the stalled link to be dropped")
        assert not link.alive

    run(body, loop)


def test_an_answer_and_batches_in_one_write_are_all_taken() -> None:
    async def body(h: Harness) -> None:
        reader, writer, nonce = await h.raw()
        blob = b"\x07" * 100_000
        writer.write(
            frame(answer(TOKEN, nonce, _hello()))
            + frame(_batch(1, attached=(len(blob),)).SerializeToString())
            + blob
            + frame(_batch(5).SerializeToString())
        )
        assert await reader.readexactly(LENGTH_BYTES) == frame(ACCEPTED)
        await h.until(lambda: len(h.handled) == 2, "both batches")
        assert [b.landed[0].lease_id for b in h.handled] == [1, 5]
        assert h.attached == [[blob], []]

    run(body)


@pytest.mark.parametrize("cut", ["peer closes mid-bytes", "places of the wrong size"])
def test_a_batch_whose_bytes_do_not_all_land_gives_its_places_back_unhandled(cut: str) -> None:
    """Whatever ends a batch before its bytes are all in (the connection, or a
    placer's bug, which closes it), its places go back and it is never handled."""
    blob = b"\x05" * 50_000

    async def body(h: Harness) -> None:
        h.short_places = cut == "places of the wrong size"
        reader, writer, nonce = await h.raw()
        writer.write(frame(answer(TOKEN, nonce, _hello())))
        assert await reader.readexactly(LENGTH_BYTES) == frame(ACCEPTED)
        writer.write(frame(_batch(1, attached=(len(blob), 10)).SerializeToString()) + blob[:999])
        await writer.drain()
        await h.until(lambda: h.placed == 2, "the batch's places")
        if not h.short_places:
            writer.transport.abort()
        await h.until(lambda: h.given_back == 2, "the places back")
        assert h.handled == [] and await _closed(reader)
        await h.honest_batch_arrives(3)

    run(body)


@pytest.mark.parametrize(
    "who",
    ["wrong token", "unknown node", "stale epoch"],
)
def test_a_dialler_that_is_no_peer_is_refused_before_anything_it_sends(who: str) -> None:
    async def body(h: Harness) -> None:
        kwargs = {
            "wrong token": {"token": b"another-token-of-16-bytes"},
            "unknown node": {"node": "node-x"},
            "stale epoch": {"epoch": "epoch-old"},
        }[who]
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await h.dial(**kwargs)  # type: ignore[arg-type]
        count("notice-channel diallers refused")
        assert h.handled == [] and h.listener.by_node == {}
        await h.honest_batch_arrives(7)

    run(body)


def test_a_recorded_answer_opens_nothing_on_another_connection() -> None:
    async def body(h: Harness) -> None:
        reader, writer, nonce = await h.raw()
        recorded = frame(answer(TOKEN, nonce, _hello()))
        writer.write(recorded)
        assert await reader.readexactly(LENGTH_BYTES) == frame(ACCEPTED)
        writer.close()
        reader2, writer2, _ = await h.raw()  # a new nonce
        writer2.write(recorded + frame(_batch(1).SerializeToString()))
        assert await _closed(reader2)
        assert h.handled == []
        await h.honest_batch_arrives(8)

    run(body)


@pytest.mark.parametrize(
    "bad",
    ["oversized answer", "garbage answer", "short answer", "silence"],
)
def test_a_bad_or_missing_answer_closes_the_connection(bad: str) -> None:
    async def body(h: Harness) -> None:
        big = "n" * MAX_HELLO  # a peer that is up, with a signed answer too long to read
        h.up.add((big, EPOCH))
        reader, writer, nonce = await h.raw()
        good = answer(TOKEN, nonce, _hello())
        data = {
            "oversized answer": frame(answer(TOKEN, nonce, _hello(big))),
            "garbage answer": frame(b"\xff" * 40),
            "short answer": frame(good[:10]),
            "silence": b"",
        }[bad]
        writer.write(data)
        assert await _closed(reader)
        count("notice-channel bad answers")
        assert h.handled == [] and h.listener.pending == 0
        await h.honest_batch_arrives(9)

    run(body)


@pytest.mark.parametrize(
    "bad",
    [
        "oversized frame",
        "not a PeerNotices",
        "another node's notices",
        "another epoch's",
        "too many bytes attached",
    ],
)
def test_a_bad_frame_after_the_answer_closes_only_that_connection(bad: str) -> None:
    async def body(h: Harness) -> None:
        h.up.add(("node-v", "epoch-v"))
        reader, writer, nonce = await h.raw()
        writer.write(frame(answer(TOKEN, nonce, _hello())))
        assert await reader.readexactly(LENGTH_BYTES) == frame(ACCEPTED)
        other = await h.dial("node-v", "epoch-v")  # another peer, connected meanwhile
        data = {
            "oversized frame": struct.pack("<I", MAX_FRAME + 1),
            "not a PeerNotices": frame(b"\x0a\xff\xff\xff\xff\x0f"),
            "another node's notices": frame(
                _batch(1, node="node-v", epoch="epoch-v").SerializeToString()
            ),
            "another epoch's": frame(_batch(1, epoch="epoch-x").SerializeToString()),
            "too many bytes attached": frame(
                _batch(1, attached=(MAX_ATTACHED // 2, MAX_ATTACHED // 2 + 1)).SerializeToString()
            ),
        }[bad]
        writer.write(
            frame(_batch(2).SerializeToString()) + data + frame(_batch(3).SerializeToString())
        )
        assert await _closed(reader)
        count("notice-channel bad frames")
        assert [b.landed[0].lease_id for b in h.handled] == [2]  # what came before stands
        assert other.send(_batch(4, node="node-v", epoch="epoch-v"))
        await h.until(lambda: len(h.handled) == 2, "the other peer's batch")
        await h.honest_batch_arrives(10)

    run(body)


def test_a_flood_of_connections_that_never_answer_is_bounded_and_expires(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Long enough that every connection below is in before the first expires.
    monkeypatch.setattr(peer_channel, "HELLO_TIMEOUT_S", 3.0)

    async def body(h: Harness) -> None:
        socks = []
        for _ in range(MAX_PENDING + 20):
            s = socket.create_connection(("127.0.0.1", h.port), timeout=WAIT_S)
            s.setblocking(False)
            socks.append(s)
        closed: set[int] = set()

        def poll() -> bool:
            for i, s in enumerate(socks):
                if i not in closed and _eof(s):
                    closed.add(i)
            return h.listener.pending == MAX_PENDING and len(closed) == 20

        # Past the cap a connection is closed at once: the last 20, not the first.
        await h.until(poll, "the pending cap")
        assert closed == set(range(MAX_PENDING, MAX_PENDING + 20))
        # The rest are closed at the answer deadline.
        await h.until(lambda: h.listener.pending == 0, "the answer deadline")
        count("notice-channel silent connections", len(socks))
        for s in socks:
            s.close()
        await h.honest_batch_arrives(11)

    run(body)


def _eof(s: socket.socket) -> bool:
    try:
        return s.recv(1 << 16) == b"" or False
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def test_a_newer_connection_of_the_same_peer_replaces_the_older() -> None:
    async def body(h: Harness) -> None:
        old = await h.dial()
        new = await h.dial()
        await h.until(lambda: not old.alive, "the older connection to close")
        assert new.send(_batch(5))
        await h.until(lambda: len(h.handled) == 1, "the batch on the newer one")
        assert not old.send(_batch(6))  # a closed link says so; the sender falls back

    run(body)


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("loop", ["asyncio", "auto"])
def test_a_connections_descriptors_all_go_with_it(loop: str) -> None:
    """The listener's end of a connection holds a second descriptor of its socket
    (see ``_Inbound.sock``): closed with it, whoever ends the connection."""

    async def body(h: Harness) -> None:
        await h.honest_batch_arrives(1)  # the loop's own descriptors, made once
        await h.until(lambda: not h.listener.conns, "the first connection to end")
        before = _descriptors()
        for tag in range(2, 6):
            await h.honest_batch_arrives(tag)  # the peer closes
            await h.until(lambda: not h.listener.conns, "the peer's close to be read")
        link = await h.dial()
        await h.until(lambda: len(h.listener.conns) == 1, "a connection to drop")
        h.listener.drop_node(NODE, EPOCH)  # this end closes
        await h.until(lambda: not link.alive, "the drop to reach the peer")
        link.close()
        await h.until(lambda: _descriptors() == before, f"{before} descriptors open again")

    run(body, loop)


@pytest.mark.parametrize("port", [-2, 65536])
def test_a_notice_port_that_is_no_port_is_refused_at_start(port: int) -> None:
    with pytest.raises(ConfigError, match="peer_notice_port"):
        Settings(peer_notice_port=port)


def test_stopping_closes_every_connection_authenticated_or_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(peer_channel, "HELLO_TIMEOUT_S", 60.0)  # only the stop may close it

    async def main() -> None:
        h = Harness()
        await h.start()
        link = await h.dial()
        reader, writer, _ = await h.raw()  # never answers
        await h.until(lambda: h.listener.pending == 1 and len(h.listener.conns) == 2, "both in")
        await h.listener.close()
        assert await _closed(reader)
        await h.until(lambda: not link.alive, "the peer's link to see the stop")
        assert h.listener.conns == set() and h.listener.pending == 0
        link.close()
        writer.transport.abort()

    asyncio.run(main())


def test_a_connection_accepted_as_the_listener_stops_is_closed_not_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loop makes an accepted connection's protocol a step before it calls
    ``connection_made``; a stop between the two must still close it, not leave it
    waiting for an answer (and its transport unclosed) after the listener is gone."""
    monkeypatch.setattr(peer_channel, "HELLO_TIMEOUT_S", 60.0)  # only the stop may close it

    async def main() -> None:
        h = Harness()
        await h.start()
        await h.listener.close()
        ours, theirs = socket.socketpair()
        with ours:
            # What the loop does with a socket accepted just before the stop.
            transport, _ = await asyncio.get_running_loop().connect_accepted_socket(
                lambda: peer_channel._Inbound(h.listener), theirs
            )
            assert transport.is_closing()
            assert h.listener.conns == set() and h.listener.pending == 0
            ours.settimeout(WAIT_S)
            assert ours.recv(1) == b""  # closed without a challenge

    asyncio.run(main())


def test_a_channel_that_will_not_open_is_tried_less_and_less_and_warned_of_rarely(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A peer advertises a port nothing answers on (a firewall): its notices ride
    Notify, the dialler backs off to a try a minute and warns at the 2nd, 4th, 8th
    failure; the peer's loss starts it afresh."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there: every dial is refused

    async def main() -> None:
        settings = types.SimpleNamespace(node_id=NODE, peer_timeout=1.0)
        links = types.SimpleNamespace(settings=settings, epoch=EPOCH, token=TOKEN)
        notifier = PeerNotifier(links, 0.0)  # type: ignore[arg-type]
        peer = PeerState("127.0.0.1:1", up=True, epoch="epoch-r", notice_port=port)
        loop = asyncio.get_running_loop()

        async def fail() -> float:
            await notifier._dial(peer, port, peer.epoch)
            assert not notifier.has_channel(peer.address)
            return notifier._retry_at[peer.address] - loop.time()

        delays = [await fail() for _ in range(9)]
        assert [round(d) for d in delays] == [1, 2, 4, 8, 16, 32, 60, 60, 60]
        notifier.forget(peer.address)
        assert round(await fail()) == 1
        await notifier.close()

    with caplog.at_level(logging.DEBUG, logger="relayd.peer_notices"):
        asyncio.run(main())
    levels = [r.levelno for r in caplog.records if "not opened" in r.getMessage()]
    assert levels.count(logging.WARNING) == 3 and levels.count(logging.INFO) == 2
