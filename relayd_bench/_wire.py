"""Framing between a benchmark writer and its reader over their Unix socketpair.

One framing for every method: a 24-byte header (``t0`` and the moment the frame
was sent, in ns, then the body length) and the body (the method's notify). A
negative length is a control frame (end of a step). The reader answers ``R``
once set up for a size and ``A`` after each transfer's cleanup and after the
end frame. So only one frame is ever in flight, and the reader can read
greedily into one buffer without over-reading. Blocking and asyncio variants of
each operation behave the same.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import NamedTuple

HEADER = struct.Struct("<qqq")
END = -1
SMALL = 64 * 1024  # bodies up to this size reuse the receive buffer
ACK = b"A"
READY = b"R"

Body = bytes | bytearray | memoryview


class BenchFailure(RuntimeError):
    """A method broke the contract (wrong tensor, stale data) or the peer went away."""


def _closed() -> BenchFailure:
    # named exactly so the parent can tell this consequence from the failure that caused it
    return BenchFailure("peer closed the socket")


class Frame(NamedTuple):
    t0: int  # the transfer's start on the writer's clock
    sent: int  # when the writer sent this frame: its send hook had returned
    length: int  # of the body; END for a control frame
    body: memoryview


class Receiver:
    """Reads whole frames; a body is valid until the next read."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray(HEADER.size + SMALL)
        self._mv = memoryview(self._buf)

    def frame(self) -> Frame:
        got = 0
        while got < HEADER.size:
            got += self._recv(self._mv[got:])
        t0, sent, length = HEADER.unpack_from(self._buf)
        if length < 0:
            return Frame(t0, sent, length, self._mv[:0])
        need = HEADER.size + length
        if need <= len(self._buf):
            while got < need:
                got += self._recv(self._mv[got:need])
            return Frame(t0, sent, length, self._mv[HEADER.size : need])
        # large bodies (pickle-uds) land in fresh memory, as a real receiver's would
        big = memoryview(bytearray(length))
        have = got - HEADER.size
        big[:have] = self._mv[HEADER.size : got]
        while have < length:
            have += self._recv(big[have:])
        return Frame(t0, sent, length, big)

    async def aframe(self) -> Frame:
        got = 0
        while got < HEADER.size:
            got += await self._arecv(self._mv[got:])
        t0, sent, length = HEADER.unpack_from(self._buf)
        if length < 0:
            return Frame(t0, sent, length, self._mv[:0])
        need = HEADER.size + length
        if need <= len(self._buf):
            while got < need:
                got += await self._arecv(self._mv[got:need])
            return Frame(t0, sent, length, self._mv[HEADER.size : need])
        big = memoryview(bytearray(length))
        have = got - HEADER.size
        big[:have] = self._mv[HEADER.size : got]
        while have < length:
            have += await self._arecv(big[have:])
        return Frame(t0, sent, length, big)

    def _recv(self, into: memoryview) -> int:
        n = self._sock.recv_into(into)
        if not n:
            raise _closed()
        return n

    async def _arecv(self, into: memoryview) -> int:
        n = await asyncio.get_running_loop().sock_recv_into(self._sock, into)
        if not n:
            raise _closed()
        return n

    def expect_end(self) -> None:
        if self.frame().length != END:
            raise BenchFailure("writer sent more frames than planned")
        self._sock.sendall(ACK)

    async def aexpect_end(self) -> None:
        if (await self.aframe()).length != END:
            raise BenchFailure("writer sent more frames than planned")
        await asyncio.get_running_loop().sock_sendall(self._sock, ACK)


def send_frame(sock: socket.socket, t0: int, body: Body, sent: int = 0) -> None:
    n = len(body)
    if n <= SMALL:
        sock.sendall(HEADER.pack(t0, sent, n) + body)  # one syscall for the common small notify
    else:
        sock.sendall(HEADER.pack(t0, sent, n))
        sock.sendall(body)


async def asend_frame(sock: socket.socket, t0: int, body: Body, sent: int = 0) -> None:
    loop = asyncio.get_running_loop()
    n = len(body)
    if n <= SMALL:
        await loop.sock_sendall(sock, HEADER.pack(t0, sent, n) + body)
    else:
        await loop.sock_sendall(sock, HEADER.pack(t0, sent, n))
        await loop.sock_sendall(sock, body)


def expect(sock: socket.socket, token: bytes) -> None:
    _check(sock.recv(1), token)


async def aexpect(sock: socket.socket, token: bytes) -> None:
    _check(await asyncio.get_running_loop().sock_recv(sock, 1), token)


def _check(got: bytes, token: bytes) -> None:
    if not got:
        raise _closed()
    if got != token:
        raise BenchFailure(f"expected {token!r} from the reader, got {got!r}")


def send_end(sock: socket.socket) -> None:
    # acknowledged, so the next step's setup frame is never in flight behind it
    sock.sendall(HEADER.pack(0, 0, END))
    expect(sock, ACK)


async def asend_end(sock: socket.socket) -> None:
    await asyncio.get_running_loop().sock_sendall(sock, HEADER.pack(0, 0, END))
    await aexpect(sock, ACK)
