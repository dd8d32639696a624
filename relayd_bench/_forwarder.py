"""The two stand-in daemons of ``floor-relay`` (see ``_relay_floor``): processes that
move the bytes and nothing else, each on an asyncio loop as relayd's daemons are.

``python -m relayd_bench._forwarder out|in FD SEGMENT SIZE STRIDE SLOTS READ_MIN HOST
PORT``: ``FD`` is the Unix socket to the writer (``out``) or the reader (``in``),
``SEGMENT`` that side's /dev/shm segment of ``SLOTS`` slots ``STRIDE`` bytes apart.
``out`` listens on ``HOST`` and prints its port, then takes one connection; ``in``
dials ``HOST:PORT`` and prints a line once connected. Either ends when its Unix
socket or the TCP connection closes. It imports no torch (nor does this package's
``__init__``): a forwarder starts in a fraction of a second.
"""

from __future__ import annotations

import asyncio
import collections
import mmap
import os
import socket
import struct
import sys
from typing import Any

from relayd_client.wire.paths import SHM_DIR

WORD = struct.Struct("<QQ")  # slot, transfer: a Publish, a header, an announcement
PID = struct.Struct("<Q")  # the reader's forwarder's pid, first on the connection
ACCEPT_TIMEOUT_S = 10.0  # the reader's forwarder dials within this
OUT, IN = "out", "in"
IOV_MAX = 1024  # buffers one writev takes (Linux's UIO_MAXIOV)


class _Slots:
    """A side's segment as its forwarder sees it."""

    def __init__(self, name: str, size: int, stride: int, nslots: int) -> None:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            self.view = memoryview(mmap.mmap(fd, os.fstat(fd).st_size))
        finally:
            os.close(fd)
        self.size, self.stride, self.nslots = size, stride, nslots

    def slot(self, k: int) -> memoryview:
        if k >= self.nslots:
            raise ValueError(f"slot {k} of {self.nslots}")
        return self.view[k * self.stride : k * self.stride + self.size]


class _Out(asyncio.Protocol):
    """The writer's forwarder: each Publish read from the writer becomes a header and
    the slot's bytes on the TCP connection, handed to the kernel from where they lie
    (what it does not take at once waits uncopied, as in relayd's notice channel)."""

    def __init__(self, tcp: socket.socket, slots: _Slots, done: Any) -> None:
        self.tcp, self.slots, self.done = tcp, slots, done
        self.pending = b""
        self.queue: collections.deque[memoryview] = collections.deque()
        loop = asyncio.get_running_loop()
        loop.add_reader(tcp.fileno(), self._readable)  # the peer sends nothing: its end

    def data_received(self, data: bytes) -> None:
        data, self.pending = self.pending + data, b""
        whole = len(data) - len(data) % WORD.size
        self.pending = data[whole:]
        for at in range(0, whole, WORD.size):
            word = memoryview(data[at : at + WORD.size])
            idle = not self.queue
            self.queue += (word, self.slots.slot(WORD.unpack(word)[0]))
            if idle:
                self._flush()

    def _flush(self) -> None:
        queue = self.queue
        while queue:
            try:
                taken = os.writev(self.tcp.fileno(), list(queue)[:IOV_MAX])
            except (BlockingIOError, InterruptedError):
                taken = 0
            while queue and taken >= len(queue[0]):
                taken -= len(queue.popleft())
            if queue and taken:
                queue[0] = queue[0][taken:]
            elif queue:
                asyncio.get_running_loop().add_writer(self.tcp.fileno(), self._writable)
                return

    def _writable(self) -> None:
        asyncio.get_running_loop().remove_writer(self.tcp.fileno())
        self._flush()

    def _readable(self) -> None:
        if not self.tcp.recv(1):
            _end(self.done)

    def connection_lost(self, exc: Exception | None) -> None:
        _end(self.done)


class _In(asyncio.BufferedProtocol):
    """The reader's forwarder: a header, then its bytes straight into the slot (woken
    once ``read_min`` of them, or all that remain, are in), then the announcement."""

    def __init__(self, slots: _Slots, read_min: int, reader: Any, done: Any) -> None:
        self.slots, self.read_min, self.reader, self.done = slots, read_min, reader, done
        self.header = bytearray(WORD.size)
        self.place: memoryview | None = None  # the slot being filled, once a header is in
        self.filled = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.sock = transport.get_extra_info("socket")

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.place is None:
            return memoryview(self.header)[self.filled :]
        return self.place[self.filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self.filled += nbytes
        size = self.slots.size
        if self.place is None:
            if self.filled < WORD.size:
                return
            self.place, self.filled = self.slots.slot(WORD.unpack(self.header)[0]), 0
        if self.filled < size:
            self._wake_at(min(size - self.filled, self.read_min))
            return
        self.reader.write(bytes(self.header))
        self.place, self.filled = None, 0
        self._wake_at(WORD.size)

    def _wake_at(self, nbytes: int) -> None:
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)

    def connection_lost(self, exc: Exception | None) -> None:
        _end(self.done)


class _Closed(asyncio.Protocol):
    """The Unix socket of a forwarder that only writes to it: its end is the run's end."""

    def __init__(self, done: Any) -> None:
        self.done = done

    def connection_lost(self, exc: Exception | None) -> None:
        _end(self.done)


def _end(done: Any) -> None:
    if not done.done():
        done.set_result(None)


async def _serve(
    role: str, unix: socket.socket, tcp: socket.socket, slots: _Slots, read_min: int
) -> None:
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    unix.setblocking(False)
    tcp.setblocking(False)
    if role == OUT:
        out = _Out(tcp, slots, done)
        await loop.connect_accepted_socket(lambda: out, unix)
    else:
        reader, _ = await loop.connect_accepted_socket(lambda: _Closed(done), unix)
        await loop.connect_accepted_socket(lambda: _In(slots, read_min, reader, done), tcp)
    await done


def recv_exactly(sock: socket.socket, nbytes: int, gone: str) -> bytes:
    """The next ``nbytes`` from ``sock``; ConnectionError(``gone``) if it ends first."""
    buf = bytearray(nbytes)
    view, got = memoryview(buf), 0
    while got < nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(gone)
        got += n
    return bytes(buf)


def main(argv: list[str] | None = None) -> int:
    role, fd, name, size, stride, nslots, read_min, host, port = (
        argv if argv is not None else sys.argv[1:]
    )
    unix = socket.socket(fileno=int(fd))
    slots = _Slots(name, int(size), int(stride), int(nslots))
    if role == OUT:
        listener = socket.create_server((host, 0))
        print(listener.getsockname()[1], flush=True)
        listener.settimeout(ACCEPT_TIMEOUT_S)
        tcp, _ = listener.accept()
        listener.close()
        tcp.settimeout(ACCEPT_TIMEOUT_S)
        said = recv_exactly(tcp, PID.size, "the reader's forwarder hung up before its pid")
        print(PID.unpack(said)[0], flush=True)  # the other side's stand-in, for its CPU
    else:
        tcp = socket.create_connection((host, int(port)), timeout=ACCEPT_TIMEOUT_S)
        tcp.sendall(PID.pack(os.getpid()))
        print("connected", flush=True)
    tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    asyncio.run(_serve(role, unix, tcp, slots, int(read_min)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
