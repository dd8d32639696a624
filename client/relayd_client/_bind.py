"""Binding a session socket: the first frame each way, read so that descriptors survive.

The daemon's answer to ``Bind`` may carry descriptors (the Freed and Release
rings, :mod:`relayd_client.wire.rings`) by ``SCM_RIGHTS``. A plain read of those
bytes, as a stream reader does, makes the kernel close them, so the answer is
read here with ``recvmsg`` before the socket becomes a stream.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import socket

from google.protobuf.message import DecodeError

from .wire.errors import DaemonUnavailableError, error_from_code
from .wire.framing import LENGTH_BYTES, MAX_FRAME, decode_frame, encode_frame, frame_length
from .wire.proto import relay_pb2 as pb
from .wire.rings import IdRing

log = logging.getLogger(__name__)

# Room for the descriptors a bind's answer may carry (two: the Freed and Release rings).
_ANCILLARY_SPACE = socket.CMSG_SPACE(4 * array.array("i").itemsize)


async def bind_session(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, bind: pb.Bind
) -> tuple[pb.SessionFrame, list[int]]:
    """Send ``bind``; the daemon's answer (BOUND), and the descriptors that came with it.

    Read with ``recvmsg``, not through a stream: a descriptor that arrives
    while a plain read takes its bytes is closed by the kernel.
    """
    fds: list[int] = []
    try:
        try:
            await loop.sock_sendall(sock, encode_frame(pb.SessionFrame(bind=bind)))
        except OSError as exc:
            # A daemon that refuses the connection sends why, then hangs up,
            # maybe before our bind arrives: read the reason all the same.
            sent: OSError | None = exc
        else:
            sent = None
        try:
            head = await _recv_exactly(loop, sock, LENGTH_BYTES, fds)
        except OSError:
            if sent is not None:
                raise sent from None
            raise
        n = frame_length(head)
        if n > MAX_FRAME:
            raise DaemonUnavailableError(f"daemon sent a {n}-byte frame")
        body = await _recv_exactly(loop, sock, n, fds)
        try:
            frame = decode_frame(body)
        except DecodeError:
            raise DaemonUnavailableError(
                "daemon answered the bind with a malformed frame"
            ) from None
        for ev in frame.event:
            if ev.kind == pb.EVENT_KIND_ERROR:
                raise error_from_code(ev.code, ev.message)
            if ev.kind == pb.EVENT_KIND_BOUND:
                return frame, fds
        raise DaemonUnavailableError("daemon answered the bind with something else")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


async def _recv_exactly(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int, fds: list[int]
) -> bytes:
    """``n`` bytes from non-blocking ``sock``; descriptors passed with them go to ``fds``."""
    buf = bytearray()
    while len(buf) < n:
        try:
            data, ancillary, _, _ = sock.recvmsg(n - len(buf), _ANCILLARY_SPACE)
        except (BlockingIOError, InterruptedError):
            await _readable(loop, sock)
            continue
        for level, kind, item in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(item[: len(item) - len(item) % got.itemsize])
                fds.extend(got)
        if not data:
            raise ConnectionResetError("end of stream")
        buf += data
    return bytes(buf)


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock, wake)
    try:
        await ready
    finally:
        loop.remove_reader(sock)


def map_rings(fds: list[int]) -> tuple[IdRing | None, IdRing | None]:
    """The Freed ring (the first of ``fds``) and the Release ring (the second), each
    None if absent or unusable; closes every fd."""
    rings: list[IdRing | None] = [None, None]
    try:
        for i, (fd, name) in enumerate(zip(fds, ("Freed", "Release"), strict=False)):
            try:
                rings[i] = IdRing.map(fd)
            except (OSError, ValueError) as exc:
                log.warning("relayd sent an unusable %s ring (%s); frames instead", name, exc)
    finally:
        for fd in fds:
            os.close(fd)
    return rings[0], rings[1]
