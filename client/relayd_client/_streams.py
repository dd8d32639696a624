"""Reassembling a request's stream of chunks on the reader side.

A writer sends chunks with ``put(..., chunk_id=k)`` and ends the stream with
``put_done`` (or fails it with ``put_error``); every one of them is a DataRef
the application carries over its own channel, in whatever order that channel
delivers. The reader hands each DataRef to ``client.feed(ref)`` and consumes
``async for chunk in client.stream(request_id, from_stage=...)``: chunks come
out in chunk-id order, the done signal (which carries the number of chunks)
ends the iteration once every chunk before it was yielded, and an error
signal (which carries the number of chunks put before it) raises
:class:`StreamError` once those chunks were yielded. ``abort(request_id)`` - here or anywhere on the node - wakes a
blocked reader with :class:`AbortedError`.

Only DataRefs are buffered here (a few hundred bytes each); a chunk's bytes
stay in the arena until the reader reaches it.

A stream is read once. When its reader is done with it - at the end, at an
error, or early (it broke out, closed the iterator, timed out) - the chunks
still buffered are discarded (their leases freed in the daemon), and so is
every chunk of it fed later: its buffer would otherwise be rebuilt by each
late chunk and kept for good, its leases held until their TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ._aborts import AbortedRequests
from ._recent import Recent
from .wire.dataref import KIND_DATA, KIND_DONE, KIND_ERROR, DataRef
from .wire.errors import (
    InvalidArgumentError,
    RelayError,
    RelayTimeoutError,
    ResourceExhaustedError,
    StreamError,
)

MAX_BUFFERED = 1 << 16
# Streams whose reader is done, remembered per client so that their late
# chunks are freed; the oldest are forgotten first (a late chunk of one of
# those is buffered again, as for a stream not read yet).
ENDED_MEMORY = 4096

StreamKey = tuple[str, str]  # (request_id, from_stage)


@dataclass(eq=False)
class StreamState:
    refs: dict[int, DataRef] = field(default_factory=dict)
    next: int = 0
    end: int | None = None  # chunk count, from the done signal
    error: str | None = None
    error_at: int = 0  # chunks put before the error signal
    aborted: bool = False
    consuming: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class Streams:
    """Per (request_id, from_stage) reassembly buffers of one client."""

    def __init__(
        self, aborts: AbortedRequests, discard: Callable[[DataRef], Awaitable[None]]
    ) -> None:
        self._by_key: dict[StreamKey, StreamState] = {}
        self._aborts = aborts
        # Requests whose buffers an abort dropped: their streams stay aborted
        # here even where the client forgets the abort (its Abort call failed).
        self._dropped = AbortedRequests()
        self._ended: Recent[StreamKey] = Recent(ENDED_MEMORY)
        # Frees an unread chunk's lease (RelayClient.discard); the loop the
        # readers run on, where those calls run (a feed may come from elsewhere).
        self._discard = discard
        self._loop: asyncio.AbstractEventLoop | None = None
        self._discarding: set[asyncio.Task[None]] = set()

    def feed(self, ref: DataRef) -> None:
        """Buffer a chunk, or note a done or error signal (addressed to this client)."""
        m = ref.fields
        if m.kind == KIND_DATA and m.chunk_id < 0:
            raise InvalidArgumentError("feed() takes stream chunks (put with chunk_id) and signals")
        key = (m.request_id, m.origin.stage)
        aborted = m.request_id in self._aborts or m.request_id in self._dropped
        if aborted and key not in self._by_key:
            # Nobody reads it now (a later stream() raises AbortedError): a
            # chunk the app delivers after the abort must not build a buffer
            # that nothing ever drops. The abort freed its lease.
            return
        if key in self._ended:
            self._free((ref,))  # its reader is done: nothing would read or drop it
            return
        st = self.state(*key)
        if m.kind == KIND_DONE:
            st.end = m.chunk_id
        elif m.kind == KIND_ERROR:
            st.error = m.message or "stream failed"
            st.error_at = m.chunk_id
        elif m.chunk_id >= st.next:
            if len(st.refs) >= MAX_BUFFERED:
                raise ResourceExhaustedError(f"more than {MAX_BUFFERED} chunks buffered")
            st.refs[m.chunk_id] = ref
        if st.aborted or aborted:
            st.aborted = True
        st.wake.set()

    async def chunks(
        self,
        request_id: str,
        from_stage: str,
        timeout: float | None,
        get: Callable[[DataRef], Awaitable[Any]],
    ) -> AsyncIterator[Any]:
        """The payloads of one stream in chunk order, each read with ``get``."""
        key = (request_id, from_stage)
        if key in self._ended:
            self._aborts.check(request_id)  # an aborted stream says so first
            # A clear error, not a fresh read: the first read's chunks were
            # yielded or freed, so a second could only wait for chunks that
            # never come again, or yield the rest of the stream with a hole.
            raise InvalidArgumentError(
                f"stream {request_id!r} from {from_stage!r} was read already (a stream is "
                "read once; its chunks left unread when that read ended were freed)"
            )
        st = self.state(request_id, from_stage)
        if st.consuming:
            raise InvalidArgumentError(f"stream {request_id!r} from {from_stage!r} is read already")
        st.consuming = True
        self._loop = asyncio.get_running_loop()
        try:
            while True:
                if st.aborted or request_id in self._dropped:
                    self._aborts.remember(request_id)
                self._aborts.check(request_id)
                ref = st.refs.pop(st.next, None)
                if ref is not None:
                    st.next += 1
                    yield await get(ref)
                    continue
                if st.error is not None and st.next >= st.error_at:
                    raise StreamError(st.error)
                if st.end is not None and st.next >= st.end:
                    return
                st.wake.clear()
                try:
                    await asyncio.wait_for(st.wake.wait(), timeout)
                except TimeoutError:
                    raise RelayTimeoutError(
                        f"no chunk {st.next} of {request_id!r} within {timeout}s"
                    ) from None
        finally:
            self._end(key, st)

    def state(self, request_id: str, from_stage: str) -> StreamState:
        key = (request_id, from_stage)
        st = self._by_key.get(key)
        if st is None:
            st = self._by_key[key] = StreamState()
        return st

    def _end(self, key: StreamKey, st: StreamState) -> None:
        """The reader is done with ``key``'s stream, however it ended: free what
        it did not read, and what comes for it later (see :meth:`feed`)."""
        if self._by_key.get(key) is st:
            del self._by_key[key]
        self._ended.add(key)  # not there: an ended stream's read raises before it ends
        if not st.aborted:  # an abort freed them all
            self._free(st.refs.values())
        st.refs.clear()

    def _free(self, refs: Iterable[DataRef]) -> None:
        """Discard unread chunks (signals hold nothing), without waiting for the daemon."""
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        for ref in refs:
            if ref.fields.kind != KIND_DATA:
                continue
            if on_loop:
                self._start_discard(ref)
            elif self._loop is not None:  # fed from another thread
                with contextlib.suppress(RuntimeError):  # the loop closed: so did the session
                    self._loop.call_soon_threadsafe(self._start_discard, ref)

    def _start_discard(self, ref: DataRef) -> None:
        task = asyncio.get_running_loop().create_task(self._discard_quietly(ref))
        self._discarding.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(self._discarding.discard)

    async def settle(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the discards under way, so that a client
        closed right after a late chunk was fed still frees its lease."""
        if self._discarding:
            await asyncio.wait(set(self._discarding), timeout=timeout)

    async def _discard_quietly(self, ref: DataRef) -> None:
        # Read or freed already (a chunk fed twice, an abort), or the session
        # is gone with its leases: nothing is left to free, and nobody to tell.
        with contextlib.suppress(RelayError):
            await self._discard(ref)

    def has(self, request_id: str) -> bool:
        return any(rid == request_id for rid, _ in self._by_key)

    def abort(self, request_id: str) -> list[DataRef]:
        """Wake every reader of ``request_id`` and drop the buffers nobody reads
        yet (the caller remembers the abort); returns the refs never read."""
        dropped: list[DataRef] = []
        for key, st in list(self._by_key.items()):
            if key[0] == request_id:
                st.aborted = True
                dropped += st.refs.values()
                st.refs.clear()
                st.wake.set()
                if not st.consuming:  # a reader's own exit drops its buffer
                    del self._by_key[key]
                    self._dropped.remember(request_id)
        return dropped
