"""Streams that end early: an abort's buffers go for good; a failed chunk is not counted."""

from __future__ import annotations

import asyncio

import pytest
import torch
from relayd_client import (
    AbortedError,
    RelayClient,
    ResourceExhaustedError,
    StreamError,
    SyncRelayClient,
    UnsafePayloadError,
)

from tests._daemon import async_wait_until, running_daemon, wait_until
from tests._daemon import drained as _drained
from tests._fixtures import separate_processes
from tests._workers import digest, make_chunk

__all__ = ["separate_processes"]  # the autouse fixture: leased chunks, as between processes

pytestmark = pytest.mark.timeout(120)

KiB = 1 << 10
MiB = 1 << 20


def test_an_aborted_stream_nobody_reads_leaves_no_buffer_even_when_chunks_come_late(
    tmp_path: object,
) -> None:
    """A process that runs for days feeds chunks of requests it then aborts
    (its user went away) and never reads: each would otherwise keep its
    stream's buffer for good, rebuilt by every chunk the app delivers late."""

    async def scenario(sock: str) -> None:
        async with RelayClient("thinker", sock) as w, RelayClient("talker", sock) as r:
            for rid in ("mine", "theirs"):
                refs = [
                    await w.put(make_chunk(i, 64 * KiB), to_stage="talker", request_id=rid,
                                chunk_id=i)
                    for i in range(3)
                ]  # fmt: skip
                done = w.put_done("talker", rid)
                r.feed(refs[0])
                assert r._streams.has(rid)
                if rid == "mine":
                    await r.abort(rid)
                else:  # another stage's abort reaches the reader as a notice
                    await w.abort(rid)
                    await async_wait_until(lambda: "theirs" in r._aborts, 10, "the aborted notice")
                assert not r._streams.has(rid)
                # The app's channel delivers the rest after the abort.
                r.feed(refs[2])
                r.feed(refs[1])
                r.feed(done)
                assert not r._streams.has(rid)
                with pytest.raises(AbortedError):
                    await anext(aiter(r.stream(rid, from_stage="thinker", timeout=10)))
            assert r._streams._by_key == {}

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d.socket), 60))
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def test_a_chunk_whose_put_failed_is_not_counted_by_the_signal_after_it(tmp_path: object) -> None:
    """put_error's (and put_done's) default count is one past the highest chunk
    put: a chunk whose put raised was never put, and counting it left the
    reader waiting for it instead of raising the writer's StreamError."""

    async def scenario(sock: str) -> None:
        async with RelayClient("thinker", sock) as w, RelayClient("talker", sock) as r:
            refs = [await w.put(make_chunk(0, 64 * KiB), to_stage="talker", request_id="e",
                                chunk_id=0)]  # fmt: skip
            with pytest.raises(UnsafePayloadError):
                await w.put({"x": object()}, to_stage="talker", request_id="e", chunk_id=1)
            with pytest.raises(ResourceExhaustedError):  # no grant this large
                await w.put({"x": torch.ones(256 * MiB, dtype=torch.uint8)}, to_stage="talker",
                            request_id="e", chunk_id=2, timeout=1)  # fmt: skip
            failed = w.put_error("talker", "e", "the producer failed")
            assert failed.proto.chunk_id == 1
            for ref in (failed, *refs):
                r.feed(ref)
            seen = []
            with pytest.raises(StreamError, match="the producer failed"):
                async for chunk in r.stream("e", from_stage="thinker", timeout=10):
                    seen.append(chunk)
            assert len(seen) == 1

            # The same for put_done, and with the blocking client's puts.
            with SyncRelayClient("thinker", sock) as s:
                chunk = make_chunk(0, 64 * KiB)
                ref = s.put(chunk, to_stage="talker", request_id="d", chunk_id=0)
                with pytest.raises(UnsafePayloadError):
                    s.put({"x": object()}, to_stage="talker", request_id="d", chunk_id=1)
                assert s.put_done("talker", "d").proto.chunk_id == 1
            assert digest(await r.get(ref)) == digest(chunk)

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d.socket), 60))
        wait_until(lambda: _drained(d), 10, "arena back to zero")
