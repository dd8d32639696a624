"""A stream its reader stopped reading early: what it left buffered and what comes late is freed.

A reader may leave ``stream()`` before the done signal (it breaks out, closes
the iterator, its request is over). The app's channel keeps delivering that
request's chunks, and each one fed used to start the stream's buffer afresh,
kept for good: nothing reads it and nothing drops it, and the chunks' leases
held the daemon's arena until their TTL.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from relayd_client import (
    AbortedError,
    DataRef,
    InvalidArgumentError,
    RelayClient,
    SyncRelayClient,
    _streams,
)

from tests._daemon import Daemon, async_wait_until, running_daemon, wait_until
from tests._daemon import drained as _drained
from tests._fixtures import separate_processes
from tests._workers import digest, make_chunk

__all__ = ["separate_processes"]  # the autouse fixture: leased chunks, as between processes

pytestmark = pytest.mark.timeout(120)

KiB = 1 << 10


def _arena_used(d: Daemon) -> int:
    return int(d.pool().get("used_bytes", 0))


def _published(d: Daemon) -> int:
    """Leases the daemon knows are published (the writer's notices linger on the way)."""
    return int(d.status()["leases_by_state"].get("published", 0))


async def _put_stream(w: RelayClient, rid: str, n: int) -> tuple[list[Any], list[DataRef]]:
    """``n`` leased chunks of ``rid`` for "talker", and the done signal after them."""
    chunks = [make_chunk(i, 64 * KiB) for i in range(n)]
    refs = [
        await w.put(c, to_stage="talker", request_id=rid, chunk_id=i) for i, c in enumerate(chunks)
    ]
    return chunks, [*refs, w.put_done("talker", rid)]


async def _first_then_stop(r: RelayClient, rid: str, how: str) -> Any:
    """Read chunk 0 of ``rid`` and stop reading, the way an app would."""
    if how == "break":
        async for first in r.stream(rid, from_stage="thinker", timeout=10):
            return first  # leaves the loop: the generator is closed when collected
    it: AsyncIterator[Any] = r.stream(rid, from_stage="thinker", timeout=10)
    chunk = await anext(it)
    await it.aclose()  # type: ignore[attr-defined]
    return chunk


@pytest.mark.parametrize("how", ["break", "aclose"])
def test_chunks_left_and_fed_after_an_early_stop_are_freed_not_buffered(
    tmp_path: object, how: str
) -> None:
    async def scenario(d: Daemon) -> None:
        async with RelayClient("thinker", d.socket) as w, RelayClient("talker", d.socket) as r:
            chunks, refs = await _put_stream(w, "r", 6)
            await async_wait_until(lambda: _published(d) == 6, 10, "6 chunks published")
            for i in (0, 1, 2, 4):  # buffered when the reader stops: 1, 2 and 4
                r.feed(refs[i])
            assert digest(await _first_then_stop(r, "r", how)) == digest(chunks[0])
            # The channel delivers the rest, and one chunk twice, after the stop.
            for i in (3, 5, 6, 2):
                r.feed(refs[i])
            await async_wait_until(
                lambda: r._streams._by_key == {}, 10, "no buffer for the stopped stream"
            )
            # Every chunk's lease is freed in the daemon: read, left buffered or late.
            await async_wait_until(lambda: _arena_used(d) == 0, 10, "every chunk's lease freed")
            # The writer may put more; the reader's other streams are untouched.
            chunks, refs = await _put_stream(w, "next", 2)
            for ref in reversed(refs):
                r.feed(ref)
            got = [c async for c in r.stream("next", from_stage="thinker", timeout=10)]
            assert [digest(c) for c in got] == [digest(c) for c in chunks]

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d), 60))
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def test_the_blocking_clients_early_stop_frees_its_chunks_too(tmp_path: object) -> None:
    with running_daemon(str(tmp_path)) as d:
        with SyncRelayClient("thinker", d.socket) as w, SyncRelayClient("talker", d.socket) as r:
            refs = [
                w.put(make_chunk(i, 64 * KiB), to_stage="talker", request_id="r", chunk_id=i)
                for i in range(4)
            ]
            refs.append(w.put_done("talker", "r"))
            wait_until(lambda: _published(d) == 4, 10, "4 chunks published")
            r.feed(refs[0])
            r.feed(refs[1])
            for _ in r.stream("r", from_stage="thinker", timeout=10):
                break  # the generator is closed here: it has no other reference
            for ref in refs[2:]:
                r.feed(ref)
            wait_until(lambda: _arena_used(d) == 0, 10, "every chunk's lease freed")
            assert r._client._streams._by_key == {}
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def test_a_reader_closed_right_after_a_late_chunk_still_frees_it(tmp_path: object) -> None:
    """The discard of a late chunk is a call on the session: close waits for it."""

    async def scenario(d: Daemon) -> None:
        async with RelayClient("thinker", d.socket) as w:
            _, refs = await _put_stream(w, "r", 3)
            await async_wait_until(lambda: _published(d) == 3, 10, "3 chunks published")
            async with RelayClient("talker", d.socket) as r:
                r.feed(refs[0])
                await _first_then_stop(r, "r", "aclose")
                for ref in refs[1:]:
                    r.feed(ref)
            await async_wait_until(lambda: _arena_used(d) == 0, 10, "every chunk's lease freed")

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d), 60))


def test_a_stream_is_read_once_a_second_read_after_its_end_is_refused(tmp_path: object) -> None:
    """Its chunks were read or freed at the first read's end: a second read
    could only wait for what never comes, or yield a stream with a hole."""

    async def scenario(sock: str) -> None:
        async with RelayClient("thinker", sock) as w, RelayClient("talker", sock) as r:
            _, refs = await _put_stream(w, "early", 3)
            r.feed(refs[0])
            await _first_then_stop(r, "early", "aclose")
            for ref in refs[1:]:
                r.feed(ref)
            with pytest.raises(InvalidArgumentError, match="read already"):
                await anext(aiter(r.stream("early", from_stage="thinker", timeout=2)))

            _, refs = await _put_stream(w, "whole", 2)
            for ref in refs:
                r.feed(ref)
            assert len([c async for c in r.stream("whole", from_stage="thinker", timeout=10)]) == 2
            with pytest.raises(InvalidArgumentError, match="read already"):
                await anext(aiter(r.stream("whole", from_stage="thinker", timeout=2)))

            # An aborted one says so, as it did before it was read.
            _, refs = await _put_stream(w, "aborted", 2)
            r.feed(refs[0])
            await _first_then_stop(r, "aborted", "aclose")
            await r.abort("aborted")
            r.feed(refs[1])
            with pytest.raises(AbortedError):
                await anext(aiter(r.stream("aborted", from_stage="thinker", timeout=2)))

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d.socket), 60))
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def test_the_memory_of_ended_streams_is_bounded(tmp_path: object) -> None:
    async def scenario(sock: str) -> None:
        async with RelayClient("thinker", sock) as w, RelayClient("talker", sock) as r:
            memory = _streams.ENDED_MEMORY
            for i in range(memory + 10):
                rid = f"r{i}"
                r.feed(w.put_done("talker", rid))
                assert [c async for c in r.stream(rid, from_stage="thinker")] == []
            assert len(r._streams._ended) == memory
            assert r._streams._by_key == {}
            # The oldest are forgotten: a stream of that name reads afresh.
            r.feed(w.put_done("talker", "r0"))
            assert [c async for c in r.stream("r0", from_stage="thinker")] == []

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d.socket), 60))
