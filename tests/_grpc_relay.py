"""A TCP relay in front of a gRPC server that tallies the HTTP/2 frames each way
and can go silent, as a vanished host does: from then on it passes nothing
either way and answers nothing. For the keepalive tests of the daemon's servers.
"""

from __future__ import annotations

import asyncio
import collections
from contextlib import suppress
from typing import Any

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEAD = 9
PING, GOAWAY = 6, 7
ACK = 0x1
CLOSE_S = 10.0  # how long close() waits for its connections to end


class Relay:
    """Relays one TCP connection at a time to the server at ``upstream``
    (``host:port``, or ``unix:path``), counting HTTP/2 frames by (direction, type,
    flags); ``silent``: nothing more crosses, either way."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.frames: collections.Counter[tuple[str, int, int]] = collections.Counter()
        self.silent = False
        self.server_closed = asyncio.Event()
        self._server: asyncio.AbstractServer | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._accepted = 0

    async def start(self) -> str:
        """Listen; the address a channel dials to reach the server through the relay."""
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    @property
    def accepted(self) -> int:
        """Connections accepted so far."""
        return self._accepted

    def count(self, direction: str, kind: int, flags: int = 0) -> int:
        return self.frames[direction, kind, flags]

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.upstream.startswith("unix:"):
            return await asyncio.open_unix_connection(self.upstream.removeprefix("unix:"))
        host, _, port = self.upstream.rpartition(":")
        return await asyncio.open_connection(host, int(port))

    async def _relay(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        # Each connection is close()'s to end from its accept on, also while the
        # upstream is still being dialled: one left open fails a later test, at
        # whatever point the collector finds its transport.
        self._writers.append(c_writer)
        self._accepted += 1
        if self._closed:
            c_writer.transport.abort()
            return
        dialling = asyncio.current_task()
        assert dialling is not None
        self._tasks.add(dialling)
        try:
            s_reader, s_writer = await self._connect()  # close() cancels it
        except OSError:
            c_writer.transport.abort()
            return
        self._writers.append(s_writer)
        to_server = asyncio.ensure_future(self._pump("up", c_reader, s_writer, len(PREFACE)))
        to_client = asyncio.ensure_future(self._pump("down", s_reader, c_writer, 0))
        self._tasks |= {to_server, to_client}
        to_client.add_done_callback(lambda _: self.server_closed.set())

    async def _pump(
        self, direction: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, skip: int
    ) -> None:
        with suppress(asyncio.IncompleteReadError, ConnectionError):
            self._pass(writer, await reader.readexactly(skip))
            while True:
                head = await reader.readexactly(FRAME_HEAD)
                body = await reader.readexactly(int.from_bytes(head[:3], "big"))
                if not self.silent:
                    self.frames[direction, head[3], head[4]] += 1
                self._pass(writer, head + body)

    def _pass(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        if not self.silent and not writer.is_closing():
            writer.write(data)

    async def close(self) -> None:
        """Stop listening and end every connection, each side's, before returning."""
        self._closed = True
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()
        async with asyncio.timeout(CLOSE_S):
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for writer in self._writers:
                writer.transport.abort()
            await asyncio.gather(*(w.wait_closed() for w in self._writers), return_exceptions=True)
            if self._server is not None:
                await self._server.wait_closed()
