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
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ._aborts import AbortedRequests
from .wire.dataref import KIND_DONE, KIND_ERROR, DataRef
from .wire.errors import (
    InvalidArgumentError,
    RelayTimeoutError,
    ResourceExhaustedError,
    StreamError,
)

MAX_BUFFERED = 1 << 16


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

    def __init__(self, aborts: AbortedRequests) -> None:
        self._by_key: dict[tuple[str, str], StreamState] = {}
        self._aborts = aborts
        # Requests whose buffers an abort dropped: their streams stay aborted
        # here even where the client forgets the abort (its Abort call failed).
        self._dropped = AbortedRequests()

    def feed(self, ref: DataRef) -> None:
        """Buffer a chunk, or note a done or error signal (addressed to this client)."""
        m = ref.fields
        key = (m.request_id, m.origin.stage)
        aborted = m.request_id in self._aborts or m.request_id in self._dropped
        if aborted and key not in self._by_key:
            # Nobody reads it now (a later stream() raises AbortedError): a
            # chunk the app delivers after the abort must not build a buffer
            # that nothing ever drops.
            return
        st = self.state(*key)
        if m.kind == KIND_DONE:
            st.end = m.chunk_id
        elif m.kind == KIND_ERROR:
            st.error = m.message or "stream failed"
            st.error_at = m.chunk_id
        elif m.chunk_id < 0:
            raise InvalidArgumentError("feed() takes stream chunks (put with chunk_id) and signals")
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
        st = self.state(request_id, from_stage)
        if st.consuming:
            raise InvalidArgumentError(f"stream {request_id!r} from {from_stage!r} is read already")
        st.consuming = True
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
            self.discard(request_id, from_stage)

    def state(self, request_id: str, from_stage: str) -> StreamState:
        key = (request_id, from_stage)
        st = self._by_key.get(key)
        if st is None:
            st = self._by_key[key] = StreamState()
        return st

    def discard(self, request_id: str, from_stage: str) -> None:
        self._by_key.pop((request_id, from_stage), None)

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
