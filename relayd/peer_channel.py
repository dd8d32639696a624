"""The one-way notices between daemons on a plain TCP connection per peer.

Why not the Peer service's ``Notify`` stream: a pushed read waits for one
notice (Landed), and a message on a gRPC stream costs ~220 us one way and
~320 us of CPU across the two daemons (gRPC's own threads and completion
queue hops); the same bytes as a length-prefixed frame on a socket cost
~25 us and ~75 us (measured: two processes on loopback, uvloop, paced
120-byte messages). The Peer service stays the fallback: a peer that
advertises no channel, or whose channel is not up, gets its notices there.

Contract:

* Every daemon with a Peer service listens on its host, port
  ``--peer-notice-port`` (0: any free port; -1: no channel), and advertises
  the port in its handshake (``PeerHello.notice_port``, 0: none).
* Frames both ways: a 4-byte little-endian length, then the body.
* A connection is authenticated by challenge and response on the shared peer
  token: the listener sends a random :data:`NONCE_BYTES` nonce; the dialler
  answers with one frame, ``HMAC-SHA256(token, DOMAIN + nonce + hello)`` then
  ``hello`` (a ``PeerNotices`` carrying only its node id and epoch). The
  listener accepts only a peer that is up here with that node id and epoch,
  and says so with one empty frame (:data:`ACCEPTED`); the dialler sends
  nothing before it. The token never crosses the wire, and a recorded answer
  opens nothing (the next nonce differs).
* Bounds: the answer within :data:`HELLO_TIMEOUT_S` and :data:`MAX_HELLO`
  bytes; at most :data:`MAX_PENDING` connections not yet authenticated
  (more are closed at once); frames at most :data:`MAX_FRAME` bytes; one
  authenticated connection per peer node (a newer one replaces it).
* After the answer, every frame is one ``PeerNotices`` from that same node
  and epoch, handled as a ``Notify`` batch is. Anything else (a bad length, a
  body that does not parse, another node's notices, a batch the handler
  refuses) closes that connection and nothing more.
* A batch whose Landed notices say ``attached`` is followed, right after its
  frame and outside any frame, by those pushes' bytes, in the order of the
  notices: the bytes of a small push travel with the notice that publishes
  them (see :mod:`relayd.push`). At most :data:`MAX_ATTACHED` bytes follow
  one batch. Once its frame is read, the listener asks where each notice's
  bytes go (``place``) and reads them straight there: the daemon places them
  in the arena run the notice names, so they cross no buffer of ours. The
  batch is handled once they have all arrived, each notice with its view
  (valid only during the call); then ``release`` gets the views back, also
  when the connection ends before they were filled (the batch then is never
  handled). While they arrive the socket wakes the listener only once
  :data:`ATTACHED_READ_MIN` of them, or all that remain, can be read.
* A peer taken for lost here has its connection dropped (:meth:`NoticeListener.drop_node`):
  one that vanished without a FIN mid-batch would else hold that batch's
  places for good. TCP keepalive ends such a connection even so, within
  :data:`KEEPALIVE_IDLE_S` + :data:`KEEPALIVE_INTERVAL_S` x :data:`KEEPALIVE_PROBES`
  of its last byte.
* Nothing is acknowledged. A connection that fails loses what it carried, as a
  failed ``Notify`` write does, and each kind of notice has its fallback (see
  :mod:`relayd.peer_notices`); a sender whose unsent bytes pass
  :data:`MAX_BUFFERED`, or whose queue has not once emptied for its stall
  timeout, drops the connection rather than buffer without bound.
* Attached bytes are sent from where they lie, with no copy: what the kernel
  does not take at once waits in the sender's queue as a view, and the sender
  says when its memory may change (``sent``: all of it taken, or the
  connection gone). Copying the rest instead cost a 16 MiB push ~1 ms of its
  ~13 on loopback (measured).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import mmap
import os
import secrets
import socket
from collections.abc import Callable, Sequence
from typing import cast

from relayd_client.wire.framing import FRAME_LENGTH, LENGTH_BYTES, frame_length
from relayd_client.wire.proto import relay_pb2 as pb

log = logging.getLogger(__name__)

DOMAIN = b"relayd peer notices v1\0"
NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
MAX_HELLO = 1024
MAX_FRAME = 4 << 20
MAX_PENDING = 64
HELLO_TIMEOUT_S = 5.0
MAX_BUFFERED = 32 << 20
# A sender whose queue has not emptied once in this long drops the connection
# (its peer stopped reading): queued bytes may be a writer's held run.
STALL_TIMEOUT_S = 30.0
MAX_ATTACHED = 16 << 20
# A listener's connection silent this long is probed, and dropped after this many
# probes unanswered this far apart: the peer sends nothing between batches, and
# its daemon's loss is told by the heartbeats, so these only bound what a peer
# that vanished costs when nothing else notices.
KEEPALIVE_IDLE_S = 60
KEEPALIVE_INTERVAL_S = 10
KEEPALIVE_PROBES = 6
# The port to listen on: 0 any free one, NO_CHANNEL none.
NO_CHANNEL = -1
STOPPING = "the daemon is stopping"
ACCEPTED = b""


def answer(token: bytes, nonce: bytes, hello: pb.PeerNotices) -> bytes:
    """The dialler's answer frame's body: the MAC, then the hello."""
    body = hello.SerializeToString()
    return hmac.digest(token, DOMAIN + nonce + body, "sha256") + body


def frame(body: bytes) -> bytes:
    return FRAME_LENGTH.pack(len(body)) + body


# Bytes asked of the kernel at a time between frames: what follows a batch's
# frame is read into its places, not here, save what one read takes along.
READ_WINDOW = 64 << 10
# While a batch's attached bytes arrive, the socket wakes the loop only once
# this many of them (or all that remain) are in (SO_RCVLOWAT): a 16 MiB push
# read as it trickled in took a wake-up per ~350 KiB.
ATTACHED_READ_MIN = 1 << 20

Handler = Callable[[pb.PeerNotices, Sequence[memoryview]], object]
Placer = Callable[[pb.PeerNotices], list[memoryview]]
Releaser = Callable[[Sequence[memoryview]], None]


def scratch(batch: pb.PeerNotices) -> list[memoryview]:
    """Fresh memory for each attached notice's bytes: a listener's default places."""
    return [memoryview(bytearray(landed.attached)) for landed in batch.landed if landed.attached]


def _nothing(views: Sequence[memoryview]) -> None:
    pass


class NoticeListener:
    """The listening side; ``accept(node_id, epoch)`` says whether that peer is up
    here, ``handle(batch, attached)`` applies a batch and the bytes that followed
    it (raising refuses it). ``place(batch)``: one writable view per Landed notice
    that attaches bytes, in order, each exactly as long, to read them into;
    ``release(views)`` takes them back after the batch is handled or abandoned."""

    def __init__(
        self,
        token: bytes,
        accept: Callable[[str, str], bool],
        handle: Handler,
        place: Placer = scratch,
        release: Releaser = _nothing,
    ) -> None:
        self.token = token
        self.accept = accept
        self.handle = handle
        self.place = place
        self.release = release
        self.pending = 0
        self.conns: set[_Inbound] = set()
        self.by_node: dict[str, _Inbound] = {}
        self.refused = 0
        self.closed = False
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Inbound(self), host, port)
        return int(self._server.sockets[0].getsockname()[1])

    def drop_node(self, node_id: str, epoch: str) -> None:
        """Close the connection of peer ``node_id`` at ``epoch``, if any, giving back
        the places of a batch whose bytes it was still reading."""
        conn = self.by_node.get(node_id)
        if conn is not None and conn.epoch == epoch:
            conn.drop("its node was taken for lost", logging.INFO)

    async def close(self) -> None:
        self.closed = True
        if self._server is not None:
            self._server.close()
            for conn in list(self.conns):
                conn.drop(STOPPING)
            await self._server.wait_closed()
            self._server = None


class _Inbound(asyncio.BufferedProtocol):
    """One connection to the listener. Frames are read into a buffer of its own, kept
    for the connection's life: a ``bytearray`` appended to and cut from the front
    with each frame gave its pages back to the kernel and faulted them in again
    on every push, a sixth of the reader's daemon's loop at 256 KiB. A batch's
    attached bytes are read into the places the listener's ``place`` gave."""

    def __init__(self, listener: NoticeListener) -> None:
        self.listener = listener
        self.transport: asyncio.Transport | None = None
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.node = ""
        self.epoch = ""
        # Unread bytes are buf[start:end]; the buffer holds the largest hello
        # until the peer has answered, then the largest batch.
        self.buf: bytearray | mmap.mmap = bytearray(LENGTH_BYTES + MAX_HELLO)
        self.start = self.end = 0
        self.timer: asyncio.TimerHandle | None = None
        self.counted = False
        # A batch read whose attached bytes are still on their way, where they
        # go, which place is being filled and how far.
        self.batch: pb.PeerNotices | None = None
        self.places: list[memoryview] = []
        self.place_index = self.place_filled = 0
        self.lowat = 1  # the socket's SO_RCVLOWAT
        # The connection's descriptor, duplicated, to set SO_RCVLOWAT on: the
        # loop's stand-in (uvloop's PseudoSocket) builds a socket object per
        # call, 2.0 us against 0.6 here, twice a push (measured).
        self.sock: socket.socket | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        lst = self.listener
        if lst.closed:  # accepted before the stop, made after it: not in conns to close
            self.drop(STOPPING)
            return
        lst.conns.add(self)
        if lst.pending >= MAX_PENDING:
            self.drop(f"more than {MAX_PENDING} connections waiting to authenticate")
            return
        lst.pending += 1
        self.counted = True
        sock = self.transport.get_extra_info("socket")
        _keep_alive(sock)
        try:
            self.sock = socket.socket(fileno=os.dup(sock.fileno()))
        except (OSError, AttributeError):  # no descriptor to set: read as it comes
            self.sock = None
        self.timer = asyncio.get_running_loop().call_later(
            HELLO_TIMEOUT_S, self.drop, f"no answer within {HELLO_TIMEOUT_S:g}s"
        )
        self.transport.write(frame(self.nonce))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.batch is not None:  # nothing buffered: straight into the place
            return self.places[self.place_index][self.place_filled :]
        buf = self.buf
        if self.end == len(buf) and self.start:
            # What is unread moves to the front (the rest of one frame at most).
            unread = self.end - self.start
            buf[:unread] = buf[self.start : self.end]
            self.start, self.end = 0, unread
        if self.end == len(buf):  # a full buffer holds more than any frame may
            self.drop("a frame larger than its bounds")
            return memoryview(bytearray(1))  # read into nothing: the connection is closed
        return memoryview(buf)[self.end : self.end + READ_WINDOW]

    def buffer_updated(self, nbytes: int) -> None:
        # A batch is set only here, between reads: this read went where
        # get_buffer said, into the place while a batch awaits its bytes.
        if self.batch is not None:
            self.place_filled += nbytes
        else:
            self.end += nbytes
        try:
            while self.transport is not None:
                if self.batch is not None:
                    if not self.fill_places():
                        self.wake_at(min(self.attached_left(), ATTACHED_READ_MIN))
                        break
                    self.wake_at(1)
                    self.finish()
                    continue
                if self.end - self.start < LENGTH_BYTES:
                    break
                buf, pos = self.buf, self.start  # an answer swaps the buffer
                n = frame_length(buf, pos)
                limit = MAX_FRAME if self.node else MAX_HELLO
                if n > limit:
                    self.drop(f"a frame of {n} bytes (at most {limit})")
                    return
                end = pos + LENGTH_BYTES + n
                if self.end < end:
                    break
                if not self.node:
                    self.start = end
                    self.on_answer(bytes(buf[pos + LENGTH_BYTES : end]))
                    continue
                batch, attached = self.parse(bytes(buf[pos + LENGTH_BYTES : end]))
                self.start = end
                if attached:
                    self.await_attached(batch)
                else:
                    self.listener.handle(batch, ())
        except Exception as exc:  # a bad frame (or a bug) ends this connection only
            self.drop(f"{type(exc).__name__}: {exc}")
            return
        if self.start == self.end:
            self.start = self.end = 0

    def on_answer(self, body: bytes) -> None:
        lst = self.listener
        mac, rest = body[:MAC_BYTES], body[MAC_BYTES:]
        want = hmac.digest(lst.token, DOMAIN + self.nonce + rest, "sha256")
        if len(mac) != MAC_BYTES or not hmac.compare_digest(mac, want):
            self.drop("wrong peer token")
            return
        hello = pb.PeerNotices.FromString(rest)
        if not lst.accept(hello.node_id, hello.daemon_epoch):
            # Often a peer whose handshake with us is still on its way: it tries again.
            why = f"node {hello.node_id[:64]!r} epoch {hello.daemon_epoch[:64]!r} is not up here"
            self.drop(why, logging.INFO)
            return
        self._uncount()
        self.node, self.epoch = hello.node_id, hello.daemon_epoch
        # Room for the largest batch, for good: a new buffer, since the loop may
        # still hold a view of the small one. Anonymous memory: only the pages
        # the biggest batch so far touched are resident.
        big = mmap.mmap(-1, LENGTH_BYTES + MAX_FRAME)
        unread = self.end - self.start
        big[:unread] = self.buf[self.start : self.end]
        self.buf, self.start, self.end = big, 0, unread
        old = lst.by_node.get(self.node)
        lst.by_node[self.node] = self
        if old is not None:
            old.drop("replaced by a newer connection")
        if self.transport is not None:
            self.transport.write(frame(ACCEPTED))

    def parse(self, body: bytes) -> tuple[pb.PeerNotices, int]:
        """A batch from this connection's peer, and how many bytes follow it."""
        batch = pb.PeerNotices.FromString(body)
        if batch.node_id != self.node or batch.daemon_epoch != self.epoch:
            raise ValueError(f"notices of node {batch.node_id[:64]!r} on node {self.node!r}'s")
        attached = sum(int(landed.attached) for landed in batch.landed)
        if attached > MAX_ATTACHED:
            raise ValueError(f"{attached} bytes attached to a batch (at most {MAX_ATTACHED})")
        return batch, attached

    def await_attached(self, batch: pb.PeerNotices) -> None:
        """Ask where ``batch``'s attached bytes go; they are read there next."""
        places = self.listener.place(batch)
        want = [int(landed.attached) for landed in batch.landed if landed.attached]
        if [len(view) for view in places] != want or any(view.readonly for view in places):
            self.give_back(places)
            raise ValueError(f"places of {[len(v) for v in places]} bytes for {want} attached")
        self.batch, self.places = batch, places
        self.place_index = self.place_filled = 0

    def fill_places(self) -> bool:
        """Move what the frame's read took along into the places; True once all are full."""
        places = self.places
        while self.place_index < len(places):
            place = places[self.place_index]
            if self.place_filled == len(place):
                self.place_index += 1
                self.place_filled = 0
                continue
            n = min(len(place) - self.place_filled, self.end - self.start)
            if n == 0:
                return False
            start, filled = self.start, self.place_filled
            # Through a view: a slice of the buffer itself would copy the bytes once more.
            with memoryview(self.buf) as unread:
                place[filled : filled + n] = unread[start : start + n]
            self.place_filled += n
            self.start += n
        return True

    def attached_left(self) -> int:
        """Bytes of the batch's places still to come."""
        return sum(len(p) for p in self.places[self.place_index :]) - self.place_filled

    def wake_at(self, nbytes: int) -> None:
        """Be woken only once ``nbytes`` can be read (never more than remain to come:
        the peer may send nothing after them for a while)."""
        sock = self.sock
        if nbytes == self.lowat or sock is None or self.transport is None:
            return
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
        except OSError:  # not a TCP socket: read as it comes
            return
        self.lowat = nbytes

    def finish(self) -> None:
        """All of the batch's bytes are in: handle it, then give its places back."""
        batch, places = self.batch, self.places
        self.batch, self.places = None, []
        assert batch is not None
        try:
            self.listener.handle(batch, places)
        finally:
            self.give_back(places)

    def give_back(self, places: list[memoryview]) -> None:
        try:
            self.listener.release(places)
        finally:
            for view in places:
                view.release()

    def drop(self, why: str, level: int = logging.WARNING) -> None:
        if self.transport is None:
            return
        lst = self.listener
        if why != STOPPING:
            lst.refused += not self.node
            log.log(
                level,
                "peer notice connection %s closed: %s",
                self.node or self.transport.get_extra_info("peername"),
                why,
            )
        self.transport.abort()
        self.connection_lost(None)

    def _uncount(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.counted:
            self.counted = False
            self.listener.pending -= 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.listener.conns.discard(self)
        self._uncount()
        self.transport = None
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()
        self.buf = bytearray()  # the connection's memory goes with it
        self.start = self.end = 0
        places, self.batch, self.places = self.places, None, []
        if places:  # abandoned before its bytes all came: never handled
            try:
                self.give_back(places)
            except Exception:  # the connection is gone either way
                log.exception("giving back the places of an unfinished batch")
        if self.node and self.listener.by_node.get(self.node) is self:
            del self.listener.by_node[self.node]


def _keep_alive(sock: socket.socket | None) -> None:
    """Probe the connection while it is idle (see :data:`KEEPALIVE_IDLE_S`)."""
    if sock is None:
        return
    options = [
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPIDLE", None), KEEPALIVE_IDLE_S),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPINTVL", None), KEEPALIVE_INTERVAL_S),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPCNT", None), KEEPALIVE_PROBES),
    ]
    for level, name, value in options:
        if name is None:  # this platform names it otherwise: its default stays
            continue
        try:
            sock.setsockopt(level, name, value)
        except (OSError, AttributeError):  # not a TCP socket: nothing to probe
            return


class NoticeLink:
    """The dialling side: one authenticated connection to one peer's listener."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        stall_timeout: float = STALL_TIMEOUT_S,
    ) -> None:
        # The listener sends nothing after its accept: the reader only tells
        # when it closed (a stream keeps its transport open after EOF).
        self._reader = reader
        self._writer = writer
        self._fd: int = writer.get_extra_info("socket").fileno()
        self._stall_timeout = stall_timeout
        # Told once the queue is empty: the kernel took every byte queued before.
        self._on_sent: list[Callable[[], object]] = []
        self._draining: asyncio.Task[None] | None = None
        # Paused while anything is queued, resumed once nothing is: drain() then
        # returns exactly when the queue has emptied.
        writer.transport.set_write_buffer_limits(high=0, low=0)

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        token: bytes,
        hello: pb.PeerNotices,
        timeout: float,
        stall_timeout: float = STALL_TIMEOUT_S,
    ) -> NoticeLink:
        """Connect and answer the challenge, within ``timeout`` s (OSError, TimeoutError)."""
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                n = frame_length(await reader.readexactly(LENGTH_BYTES))
                if n != NONCE_BYTES:
                    raise ConnectionError(f"peer notice listener sent a {n}-byte challenge")
                nonce = await reader.readexactly(n)
                writer.write(frame(answer(token, nonce, hello)))
                await writer.drain()
                # Refused (a wrong token, or we are not up there yet): closed instead.
                n = frame_length(await reader.readexactly(LENGTH_BYTES))
                if n != len(ACCEPTED):
                    raise ConnectionError(f"peer notice listener sent {n} bytes, not its accept")
            except BaseException:
                writer.transport.abort()
                raise
        return cls(reader, writer, stall_timeout)

    @property
    def alive(self) -> bool:
        return not (self._writer.transport.is_closing() or self._reader.at_eof())

    @property
    def backlog(self) -> int:
        """Bytes queued here, not yet taken by the kernel."""
        return self._writer.transport.get_write_buffer_size()

    def send(
        self,
        batch: pb.PeerNotices,
        attached: Sequence[bytes | memoryview] = (),
        sent: Callable[[], object] | None = None,
    ) -> bool:
        """Queue one batch and the bytes its Landed notices attach, in their order;
        False (and the connection closed) when it cannot go.

        ``attached`` is read where it lies until ``sent`` is called: at once when
        the kernel took it all in this call, else when the queue has emptied or
        the connection ended (its bytes then are lost, as the batch is). Not
        called when this returns False.
        """
        transport = self._writer.transport
        if not self.alive or self.backlog > MAX_BUFFERED:
            transport.abort()
            return False
        parts = [frame(batch.SerializeToString()), *attached]
        taken = 0
        if self.backlog == 0:
            # Nothing queued, so nothing to overtake: the kernel takes them from
            # where they lie, in one call (the transport's writelines joins them
            # into one more copy first, before 3.12). Its socket is open while
            # it is not closing.
            try:
                taken = os.writev(self._fd, parts)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                transport.abort()
                return False
        for part in parts:
            if taken >= len(part):
                taken -= len(part)
                continue
            # A view, queued behind what went: the bytes stay where they are.
            transport.write(memoryview(part)[taken:])
            taken = 0
        if sent is not None:
            self._when_sent(sent)
        return True

    def _when_sent(self, callback: Callable[[], object]) -> None:
        if self.backlog == 0:
            callback()
            return
        self._on_sent.append(callback)
        if self._draining is None:
            self._draining = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        """Wait until the queue is empty, then tell whoever waits for it."""
        transport = self._writer.transport
        deadline = asyncio.timeout(self._stall_timeout)
        try:
            async with deadline:
                while self.backlog > 0:
                    # Returns once the queue has emptied; more may be queued by then.
                    await self._writer.drain()
        except (OSError, RuntimeError):
            # Closed (what was queued is lost, the batches with it), or stalled.
            if deadline.expired():
                log.warning(
                    "notice channel queue not emptied within %gs; dropping the channel",
                    self._stall_timeout,
                )
                transport.abort()
        finally:
            if self._draining is asyncio.current_task():
                self._draining = None
            self._tell_sent()

    def _tell_sent(self) -> None:
        callbacks, self._on_sent = self._on_sent, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # one waiter's failure is not the others'
                log.exception("after a notice channel's bytes went")

    def close(self) -> None:
        """Drop the connection; whoever waits for queued bytes is told now."""
        self._writer.transport.abort()
        if self._draining is not None:
            self._draining.cancel()  # it may not have started: told here
            self._draining = None
        self._tell_sent()


__all__ = [
    "ACCEPTED",
    "DOMAIN",
    "HELLO_TIMEOUT_S",
    "MAX_ATTACHED",
    "MAX_FRAME",
    "MAX_HELLO",
    "MAX_PENDING",
    "NONCE_BYTES",
    "NO_CHANNEL",
    "NoticeLink",
    "NoticeListener",
    "answer",
    "frame",
]
