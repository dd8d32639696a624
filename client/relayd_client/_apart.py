"""A session's announcement socket: the pushes its daemon announces, heard by a caller thread.

A ``LandedPush`` (or a decline) on the session socket is read by the client's
loop thread. A blocking client's get that waits for one then waits twice: for
the loop thread to wake and handle the frame, and for its own thread to wake
when the loop thread sets its event; after a 256 KiB push on two busy cores,
the daemon's write to the caller's return from that wait took ~185 us, ~80 of
them from the event set to the caller running (measured). So a blocking client
asks for these frames apart (``Bind.announcements``): the daemon passes one
end of a ``SOCK_SEQPACKET`` pair with the BOUND event, writes each such
frame there as one message, and the waiting caller reads them itself. That
took the daemon's announcement to the caller's return from the wait from
~210 to ~130 us; in three alternating pairs of stop-and-wait runs at 256 KiB
the blocking reader's CPU per transfer went from 307-359 to 247-268 us and
the median from 601-741 to 578-605 us (measured).

The daemon never waits for this socket. A frame that finds it full (unread
for a few hundred announcements) or closed goes on the session socket, where
the loop thread hears it as before; so a caller that found nothing here
looks in what the loop heard too (:class:`~relayd_client._remote.Announced`).
What either one hears is a hint, as every announcement is: the read checks the
lease's slot header.

One thread reads at a time (:attr:`lock`); another that waits meanwhile waits
on its event, which the reading thread sets as it hears the frame. Closing
wakes the reading thread, then takes the lock, so no read meets a closed (or
reused) descriptor and a close waits for no poll.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import socket
import threading

from google.protobuf.message import DecodeError

from .wire.framing import MAX_FRAME, decode_frame
from .wire.proto import relay_pb2 as pb

log = logging.getLogger(__name__)

# A message longer than this is cut (and then refused): the daemon sends one
# LandedPush or declined push per message, a few hundred bytes.
MAX_MESSAGE = 64 << 10
assert MAX_MESSAGE <= MAX_FRAME


class AnnouncementSocket:
    """This client's end of its session's announcement socket."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock: socket.socket | None = sock
        self._ended: socket.socket | None = None  # ours, once the daemon's end is gone
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self.lock = threading.Lock()

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
