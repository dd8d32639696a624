"""A session's announcement socket: the pushes its daemon announces, heard by a caller thread.

A ``LandedPush`` (or a decline) on the session socket is read by the client's
loop thread. A blocking client's get that waits for one then waits twice: for
the loop thread to wake and handle the frame, and for its own thread to wake
when the loop thread sets its event. After a 256 KiB push on two busy cores,
the daemon's announcing to the caller's return from that wait took ~210 us,
~80 of them from the event set to the caller running (measured). So a
blocking client asks for these frames apart (``Bind.announcements``): the
daemon passes one end of a ``SOCK_SEQPACKET`` pair with the BOUND event,
writes each such frame there as one message, and the waiting caller reads
them itself. The same span then took ~130 us; in three alternating pairs of
stop-and-wait runs at 256 KiB the blocking reader's CPU per transfer went
from 307-359 to 247-268 us and the median from 601-741 to 578-605 us
(measured).

The daemon never waits for this socket. A frame that finds it full (unread
for a few hundred announcements) or closed goes on the session socket, where
the loop thread hears it as before; so a caller that found nothing here
looks in what the loop heard too (:class:`~relayd_client._remote.Announced`).
What either one hears is a hint, as every announcement is: the read checks the
lease's slot header.

One waiting get reads at a time (:attr:`lock`), and hears every frame that
comes meanwhile: each other get waiting (a :class:`Waiter`) sleeps until the
reader hears its announcement and wakes it, or, once the reader leaves, is
handed the reading (:meth:`AnnouncementSocket.wait`). No waiting thread polls
by the clock: with sixteen blocking gets waiting at once (the 16-stream
workload, one thread a stream), waking each every 200 us to look took the
p99 from 2.7-3.6 to 8.2-8.8 ms; with these wake-ups, 1.8-3.5 (measured).
Closing wakes the reading thread, then takes the lock, so no read meets a
closed (or reused) descriptor and a close waits for no poll.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable

from google.protobuf.message import DecodeError

from .wire.framing import MAX_FRAME, decode_frame
from .wire.proto import relay_pb2 as pb

log = logging.getLogger(__name__)

# A message longer than this is cut (and then refused): the daemon sends one
# LandedPush or declined push per message, a few hundred bytes.
MAX_MESSAGE = 64 << 10
assert MAX_MESSAGE <= MAX_FRAME


Hear = Callable[[list[pb.SessionFrame]], None]


class Waiter:
    """A get waiting for its push's announcement: :meth:`tell` is what hearing it
    (or its decline) calls, on whichever thread heard it."""

    __slots__ = ("_wake", "heard")

    def __init__(self) -> None:
        self.heard = False
        self._wake = threading.Event()  # told, or handed the reading

    def tell(self) -> None:
        self.heard = True
        self._wake.set()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s to be told, by the loop thread (no announcement
        socket, or one that has ended)."""
        return self._wake.wait(timeout) and self.heard


class AnnouncementSocket:
    """This client's end of its session's announcement socket."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock: socket.socket | None = sock
        self._ended: socket.socket | None = None  # ours, once the daemon's end is gone
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self.lock = threading.Lock()  # held by the one thread reading
        self._waiters: dict[Waiter, None] = {}  # in the order they came
        self._waiters_lock = threading.Lock()

    def wait(self, waiter: Waiter, timeout: float, hear: Hear) -> bool:
        """Wait up to ``timeout`` s until ``waiter`` is told, reading the socket
        (what it reads goes to ``hear``) whenever no other thread does; whether it
        was told. Once the socket has ended, the loop thread hears what is left,
        on the session socket, and tells it."""
        deadline = time.monotonic() + timeout
        wake = waiter._wake
        with self._waiters_lock:
            self._waiters[waiter] = None
        try:
            while not waiter.heard:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                wake.clear()
                if waiter.heard:
                    break
                if not self.lock.acquire(blocking=False):
                    wake.wait(left)  # told, or handed the reading
                    continue
                try:
                    frames = self.listen(left)
                finally:
                    self.lock.release()
                if frames is None:
                    return waiter.wait(max(0.0, deadline - time.monotonic()))
                hear(frames)
            return True
        finally:
            with self._waiters_lock:
                del self._waiters[waiter]
                after = next((w for w in self._waiters if not w.heard), None)
            if after is not None:
                after._wake.set()  # its turn to read, unless another thread reads already

    def drain(self, hear: Hear) -> None:
        """Hear what was told here so far, without waiting (nothing, if another
        thread is reading: it hears it)."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            frames = self.listen(0.0)
        finally:
            self.lock.release()
        if frames:
            hear(frames)

    @classmethod
    def adopt(cls, fd: int) -> AnnouncementSocket | None:
        """The socket of descriptor ``fd`` (from the daemon's BOUND event), or None,
        ``fd`` closed, when it is not a Unix ``SOCK_SEQPACKET`` socket."""
        try:
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            os.close(fd)
            log.warning("relayd sent an unusable announcement socket (%s)", exc)
            return None
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_SEQPACKET:
            log.warning("relayd sent an announcement descriptor that is no packet socket")
            sock.close()
            return None
        sock.set_inheritable(False)  # recvmsg gave it no close-on-exec: an exec must not keep it
        return cls(sock)

    def listen(self, timeout: float) -> list[pb.SessionFrame] | None:
        """The frames told here so far, waiting up to ``timeout`` s for the first
        if none is; the caller holds :attr:`lock`. None: the socket is closed, or
        the daemon's end is (the session is ending), so nothing more comes here."""
        sock = self._sock
        if sock is None:
            return None
        frames = self._take(sock)
        if frames or timeout <= 0 or self._sock is None:
            return frames
        if self._poll.poll(math.ceil(timeout * 1000)):  # whole ms: poll's unit
            frames = self._take(sock)
        return frames

    def _take(self, sock: socket.socket) -> list[pb.SessionFrame]:
        frames: list[pb.SessionFrame] = []
        while True:
            try:
                data = sock.recv(MAX_MESSAGE)
            except (BlockingIOError, InterruptedError):
                return frames
            except OSError as exc:
                log.debug("announcement socket failed: %s", exc)
                data = b""
            if not data:  # the daemon's end is gone: its session ends too
                self._sock = None  # closed by close(), which the session's end calls
                self._ended = sock
                return frames
            try:
                frames.append(decode_frame(data))
            except DecodeError:
                log.warning("relayd sent a malformed announcement; ignored")

    def close(self) -> None:
        """Close it, at once: a thread listening wakes (shut down, the socket reads
        as ended) and lets go of the lock, rather than poll to the end of its wait."""
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with self.lock:
            sock, self._sock = self._sock or self._ended, None
            self._ended = None
        if sock is not None:
            sock.close()
