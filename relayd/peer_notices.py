"""One-way notices between daemons, batched per peer.

Pushes that landed or were declined, attached pushes received, push-grant runs
freed, pulled leases to free: none of them is answered, so none is worth a
call of its own. Each peer
has one pending :class:`relayd_client.wire.proto.relay_pb2.PeerNotices`. A
batch goes on the peer's notice channel (:mod:`relayd.peer_channel`, a plain
authenticated TCP connection) when it has one up, else on one long-lived
``Peer.Notify`` stream (a message on it costs about half a unary call, in
latency and CPU, and ten times a channel frame), with at most one write in
flight on it; whatever is added meanwhile rides the next write, which goes as
soon as the one before is done.
Under load that batches like the session's notices; idle, a notice leaves at
the end of the loop turn that made it. Frees, releases and receipts may
linger (``linger``), since nothing waits for them.

A batch that grew past its usual size (its peer's write was slow, up to the
peer timeout) goes as several messages, in order, each at most
:data:`MAX_BATCH` notices and about :data:`MAX_MESSAGE_BYTES`: one message
over gRPC's 4 MiB (or a channel frame's ``MAX_FRAME``) would be refused whole.

A write that fails is dropped, not retried, and the stream is opened anew for
the next batch: the peer is gone or cut off, and each kind has its fallback
there (a reader waiting for a push ends at the peer timeout or the peer's
loss; a writer's pulled lease ends at its TTL). A write returns before the peer
has read it, so a stream that the peer ends (it refused a message, or went) is
watched for, not found at the next write: the notices written on it lately are
logged and counted as lost (:meth:`PeerNotifier.lost`), and dropped too.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.status import from_rpc_error

from .peer_channel import HELLO_TIMEOUT_S, MAX_ATTACHED, NoticeLink
from .peer_links import PeerLinks, PeerState, split_address

log = logging.getLogger(__name__)

# A batch goes early once it holds this many notices, and a message carries no more.
MAX_BATCH = 512
# What one message carries at most (encoded), but for a single notice larger than
# this: well under gRPC's default 4 MiB a message and the channel's MAX_FRAME.
MAX_MESSAGE_BYTES = 1 << 20
# A notice's bytes in a message besides its own: its field's tag and its length.
_NOTICE_FRAMING = 6
# The kinds of notices in the order the receiver handles a batch's
# (``PushManager.on_notices``): the messages a batch is cut into, handled one
# after the other, do what it would.
_KINDS = ("released", "freed", "declined", "received", "unreceived", "landed")
# Unsent bytes on a peer's notice channel past which a push no longer rides it
# (it goes as a Mooncake WRITE): below the backlog that drops the channel
# (MAX_BUFFERED), leaving room for the notices queued behind it.
ATTACH_BACKLOG_MAX = 24 << 20
# After a notice channel could not be opened, how long its peer's notices ride
# the Peer service before the next try: the first try often comes before the
# peer has dialled us back, and is refused; then twice as long after each
# failure, up to CHANNEL_RETRY_MAX_S (a firewalled port costs a try a minute).
CHANNEL_RETRY_S = 1.0
CHANNEL_RETRY_MAX_S = 60.0


def notice_count(batch: pb.PeerNotices) -> int:
    return sum(len(getattr(batch, kind)) for kind in _KINDS)


def split(batch: pb.PeerNotices) -> list[pb.PeerNotices]:
    """``batch``'s notices, in its kinds' and their order, as messages of at most
    :data:`MAX_BATCH` notices and :data:`MAX_MESSAGE_BYTES` bytes (a notice larger
    than that goes alone); ``batch`` itself when it is within both."""
    if notice_count(batch) <= MAX_BATCH and batch.ByteSize() <= MAX_MESSAGE_BYTES:
        return [batch]
    messages = [pb.PeerNotices()]
    count = size = 0
    for kind in _KINDS:
        for notice in getattr(batch, kind):
            cost = notice.ByteSize() + _NOTICE_FRAMING
            if count and (count == MAX_BATCH or size + cost > MAX_MESSAGE_BYTES):
                messages.append(pb.PeerNotices())
                count = size = 0
            getattr(messages[-1], kind).append(notice)
            count += 1
            size += cost
    return messages


@dataclasses.dataclass(eq=False)
class _Stream:
    """A peer's Notify stream, and the notices written on it within the peer
    timeout: those its end may have lost. The peer handles a message as it
    reads it, and one that has read nothing for longer fails our heartbeats and
    is forgotten, its notices with it."""

    call: Any  # grpc.aio.StreamUnaryCall
    peer_timeout: float
    written: collections.deque[tuple[float, int]] = dataclasses.field(
        default_factory=collections.deque
    )

    def wrote(self, notices: int) -> None:
        now = asyncio.get_running_loop().time()
        self.written.append((now, notices))
        while self.written[0][0] < now - self.peer_timeout:
            self.written.popleft()

    def unread(self) -> int:
        since = asyncio.get_running_loop().time() - self.peer_timeout
        return sum(n for at, n in self.written if at >= since)


@dataclasses.dataclass(eq=False)
class _Outbox:
    pending: pb.PeerNotices = dataclasses.field(default_factory=pb.PeerNotices)
    count: int = 0
    busy: bool = False
    timer: asyncio.TimerHandle | None = None
    stream: _Stream | None = None  # opened on first use


class PeerNotifier:
    """Outboxes by peer address, written to the live peers of ``links``."""

    def __init__(self, links: PeerLinks, linger: float) -> None:
        self._links = links
        self._linger = linger
        self._boxes: dict[str, _Outbox] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._channels: dict[str, NoticeLink] = {}
        self._dialling: dict[str, asyncio.Task[None]] = {}
        self._retry_at: dict[str, float] = {}
        self._failures: dict[str, int] = {}  # by peer: tries in a row that failed
        self._channel_batches: dict[str, int] = {}  # by peer: sent on its channel
        self._lost: collections.Counter[str] = collections.Counter()  # by peer, on Notify

    def channel_batches(self, address: str) -> int:
        return self._channel_batches.get(address, 0)

    def lost(self, address: str) -> int:
        """Notices to ``address`` that a failed write or the end of a Notify stream
        lost (or may have: a stream's end, those written on it lately)."""
        return self._lost[address]

    def queued(self, address: str) -> int:
        """Bytes queued on ``address``'s notice channel that its kernel has not
        taken yet (attached pushes among them hold their writers' runs)."""
        link = self._channels.get(address)
        return link.backlog if link is not None else 0

    def has_channel(self, address: str) -> bool:
        link = self._channels.get(address)
        return link is not None and link.alive

    def ensure_channel(self, peer: PeerState) -> None:
        """Open ``peer``'s notice channel unless it is up, being opened, advertised
        by no listener, or failed within :data:`CHANNEL_RETRY_S`."""
        address = peer.address
        if not peer.notice_port or self.has_channel(address) or address in self._dialling:
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self._retry_at.get(address, 0.0):
            return
        task = loop.create_task(self._dial(peer, peer.notice_port, peer.epoch))
        self._dialling[address] = task
        task.add_done_callback(lambda t: self._dialled(address, t))

    def _dialled(self, address: str, task: asyncio.Task[None]) -> None:
        if self._dialling.get(address) is task:
            del self._dialling[address]

    async def _dial(self, peer: PeerState, port: int, epoch: str) -> None:
        links = self._links
        host, _ = split_address(peer.address)
        hello = pb.PeerNotices(node_id=links.settings.node_id, daemon_epoch=links.epoch)
        # No longer than the listener waits for our answer.
        timeout = min(links.settings.peer_timeout, HELLO_TIMEOUT_S)
        try:
            link = await NoticeLink.open(host, port, links.token, hello, timeout)
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            failures = self._failures[peer.address] = self._failures.get(peer.address, 0) + 1
            delay = min(CHANNEL_RETRY_S * 2 ** (failures - 1), CHANNEL_RETRY_MAX_S)
            self._retry_at[peer.address] = asyncio.get_running_loop().time() + delay
            # The first failure is the usual race above; after that, a warning at the
            # 2nd, 4th, 8th... failure, not one a minute forever.
            level = logging.INFO if failures == 1 else logging.WARNING
            log.log(
                level if failures & (failures - 1) == 0 else logging.DEBUG,
                "notice channel to peer %s (port %d) not opened, notices ride the Peer service: %r",
                peer.address,
                port,
                exc,
            )
            return
        if not peer.up or peer.epoch != epoch or peer.notice_port != port:
            link.close()  # the peer went (or restarted) meanwhile
            return
        old = self._channels.pop(peer.address, None)
        if old is not None:
            old.close()
        self._channels[peer.address] = link
        self._failures.pop(peer.address, None)
        log.info("notice channel to peer %s open (port %d)", peer.address, port)

    def send_attached(
        self,
        address: str,
        landed: pb.PushLanded,
        data: bytes | memoryview,
        sent: Callable[[], object],
    ) -> bool:
        """One Landed notice with its push's bytes right after it, on ``address``'s
        notice channel, now; False (and nothing sent) when they cannot go there.
        ``data`` is read where it lies until ``sent`` is called (see
        :meth:`NoticeLink.send`), which is never when this returns False."""
        link = self._channels.get(address)
        if (
            link is None
            or not link.alive
            or len(data) > MAX_ATTACHED
            or link.backlog + len(data) > ATTACH_BACKLOG_MAX
        ):
            return False
        batch = self._stamped(pb.PeerNotices())
        batch.landed.append(landed)
        if not link.send(batch, (data,), sent):
            self._channel_closed(address)
            return False
        self._channel_sent(address)
        return True

    def box(self, address: str) -> pb.PeerNotices:
        """The batch to add notices to; call :meth:`send` after adding."""
        return self._outbox(address).pending

    def send(self, address: str, *, urgent: bool = True, added: int = 1) -> None:
        """Send what ``box(address)`` holds: at the end of this turn when ``urgent``
        (a reader may be waiting for it), else within ``linger``."""
        ob = self._outbox(address)
        ob.count += added
        if ob.busy:
            return  # goes when the call in flight returns
        if urgent or ob.count >= MAX_BATCH or self._linger <= 0:
            if ob.timer is not None:
                ob.timer.cancel()
                ob.timer = None
            self._start(address, ob)
        elif ob.timer is None:
            loop = asyncio.get_running_loop()
            ob.timer = loop.call_later(self._linger, self._due, address)

    def forget(self, address: str) -> None:
        """The peer went down: what was pending for it is void."""
        ob = self._boxes.pop(address, None)
        if ob is not None:
            if ob.timer is not None:
                ob.timer.cancel()
            if ob.stream is not None:
                ob.stream.call.cancel()
        link = self._channels.pop(address, None)
        if link is not None:
            link.close()
        self._failures.pop(address, None)  # it may come back configured otherwise
        self._retry_at.pop(address, None)
        dialling = self._dialling.pop(address, None)
        if dialling is not None:
            dialling.cancel()

    async def close(self) -> None:
        for link in self._channels.values():
            link.close()
        self._channels.clear()
        # Awaited with the rest below: a dial cancelled mid-connect closes its
        # connection as it ends, before this returns.
        dialling = list(self._dialling.values())
        for task in dialling:
            task.cancel()
        for ob in self._boxes.values():
            if ob.timer is not None:
                ob.timer.cancel()
            if ob.stream is not None:
                ob.stream.call.cancel()
        self._boxes.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *dialling, return_exceptions=True)

    # -- internals ---------------------------------------------------------------------

    def _outbox(self, address: str) -> _Outbox:
        ob = self._boxes.get(address)
        if ob is None:
            ob = self._boxes[address] = _Outbox()
        return ob

    def _due(self, address: str) -> None:
        ob = self._boxes.get(address)
        if ob is not None:
            ob.timer = None
            if not ob.busy:
                self._start(address, ob)

    def _stamped(self, batch: pb.PeerNotices) -> pb.PeerNotices:
        """``batch``, saying which node and epoch it comes from."""
        batch.node_id = self._links.settings.node_id
        batch.daemon_epoch = self._links.epoch
        return batch

    def _channel_sent(self, address: str) -> None:
        self._channel_batches[address] = self._channel_batches.get(address, 0) + 1

    def _channel_closed(self, address: str) -> None:
        # Closed (the peer went, or stopped reading): this batch and the next
        # ride the Peer service until the channel is opened again.
        del self._channels[address]
        log.warning("notice channel to peer %s closed; notices ride the Peer service", address)

    def _start(self, address: str, ob: _Outbox) -> None:
        if not ob.count:
            return
        batch, ob.pending, ob.count = ob.pending, pb.PeerNotices(), 0
        messages = [self._stamped(message) for message in split(batch)]
        link = self._channels.get(address)
        if link is not None:
            for i, message in enumerate(messages):
                if not link.send(message):
                    self._channel_closed(address)
                    messages = messages[i:]  # this one and the rest ride the Peer service
                    break
                self._channel_sent(address)
            else:
                return
        ob.busy = True
        self._spawn(self._write(address, ob, messages))

    def _open(self, address: str, ob: _Outbox) -> _Stream | None:
        """A fresh Notify stream to ``address``, watched until it ends."""
        stub = self._links.stub_for(address)
        if stub is None:
            return None
        call = stub.Notify(metadata=self._links.metadata())
        stream = ob.stream = _Stream(call, self._links.settings.peer_timeout)
        self._spawn(self._watch(address, ob, stream))
        return stream

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` as a task held here until it ends (the loop keeps only a weak
        reference), cancelled by :meth:`close`."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self, address: str, ob: _Outbox, stream: _Stream) -> None:
        """Until ``stream`` ends. One that the peer ended (it refused a message, or
        went) says so now, not at the next write, which may never come: what was
        written on it lately is lost, and the next batch opens a fresh stream."""
        try:
            await stream.call
            why = "the peer closed it"  # it answers only once we are done writing
        except grpc.RpcError as exc:
            why = from_rpc_error(exc).message
        except asyncio.CancelledError:
            return  # ended here: a write failed, the peer was forgotten, or we close
        if ob.stream is stream:
            ob.stream = None
        lost = stream.unread()
        if not lost:
            log.info("Notify stream to peer %s ended: %s", address, why)
            return
        self._lost[address] += lost
        log.warning(
            "Notify stream to peer %s ended: %s; up to %d notice(s) written on it in the "
            "last %.1fs lost",
            address,
            why,
            lost,
            stream.peer_timeout,
        )

    async def _write(self, address: str, ob: _Outbox, messages: list[pb.PeerNotices]) -> None:
        sent = 0
        try:
            stream = ob.stream
            if stream is None or stream.call.done():
                stream = self._open(address, ob)
                if stream is None:
                    return
            for message in messages:
                await asyncio.wait_for(stream.call.write(message), stream.peer_timeout)
                stream.wrote(notice_count(message))
                sent += 1
        except (grpc.RpcError, asyncio.InvalidStateError, TimeoutError) as exc:
            failed, ob.stream = ob.stream, None
            if failed is not None:
                failed.call.cancel()
            why = from_rpc_error(exc).message if isinstance(exc, grpc.RpcError) else repr(exc)
            lost = sum(notice_count(message) for message in messages[sent:])
            self._lost[address] += lost
            log.warning("%d notice(s) to peer %s lost: %s", lost, address, why)
        finally:
            ob.busy = False
            if self._boxes.get(address) is ob and ob.count and ob.timer is None:
                self._start(address, ob)


__all__ = [
    "ATTACH_BACKLOG_MAX",
    "MAX_BATCH",
    "MAX_MESSAGE_BYTES",
    "PeerNotifier",
    "notice_count",
    "split",
]
