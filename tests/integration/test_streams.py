"""Streams: chunks in order over a reordering app channel, done and error signals, abort."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import random
import subprocess

import pytest
import torch
from relayd_client import AbortedError, InvalidArgumentError, RelayClient, StreamError

from tests._daemon import Daemon, async_wait_until, running_daemon, spawn_worker, wait_until
from tests._daemon import drained as _drained
from tests._workers import make_chunk

pytestmark = pytest.mark.timeout(180)

KiB = 1 << 10
MiB = 1 << 20


def _shuffled_windows(lines: list[bytes], window: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    out: list[bytes] = []
    for i in range(0, len(lines), window):
        part = lines[i : i + window]
        rng.shuffle(part)
        out += part
    return out


def _send(reader: subprocess.Popen[bytes], lines: list[bytes]) -> None:
    # A reader that hit the error signal exits without reading the rest.
    assert reader.stdin is not None
    with contextlib.suppress(BrokenPipeError):
        reader.stdin.writelines(lines)
        reader.stdin.flush()


def _pipe(
    writer: subprocess.Popen[bytes], reader: subprocess.Popen[bytes], window: int
) -> tuple[list[str], list[str]]:
    """The app channel: writer's DataRefs to the reader, reordered within each window.

    Returns (the writer's chunk digests in chunk order, the reader's output lines).
    """
    assert writer.stdout is not None and reader.stdin is not None and reader.stdout is not None
    rng = random.Random(7)
    expected: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        output = pool.submit(reader.stdout.read)
        pending: list[bytes] = []
        for line in writer.stdout:
            parts = line.split()
            if parts[0] == b"ERR":
                raise AssertionError(line.decode())
            if len(parts) == 3:
                expected.append(parts[1].decode())
            pending.append(line)
            if len(pending) == window:
                rng.shuffle(pending)
                _send(reader, pending)
                pending = []
        rng.shuffle(pending)
        _send(reader, [*pending, b"\n"])
        with contextlib.suppress(BrokenPipeError):
            reader.stdin.close()
        assert writer.wait(timeout=60) == 0
        got = output.result(timeout=120).decode().splitlines()
    assert reader.wait(timeout=60) == 0
    return expected, got


def test_500_chunks_arrive_in_order_through_a_reordering_channel(tmp_path: object) -> None:
    # 500 chunks of 40 KiB (one 64 KiB slot each) are twice the 16 MiB arena:
    # the writer can only finish because each DataRef is handed out before
    # anything waits, and the reader frees space as it reads.
    with running_daemon(str(tmp_path), "--grant-size", "1MiB", pool="16MiB") as d:
        capacity = int(d.pool()["capacity_bytes"])
        assert 500 * 64 * KiB > capacity
        writer = spawn_worker(
            ["stream-write", "--socket", d.socket, "--count", "500", "--sizes", str(40 * KiB),
             "--timeout", "60"]
        )  # fmt: skip
        reader = spawn_worker(["stream-read", "--socket", d.socket])
        assert reader.stdout is not None
        assert reader.stdout.readline().strip() == b"READY"
        expected, got = _pipe(writer, reader, window=8)
        assert len(expected) == 500
        assert got == [*expected, "END"]
        wait_until(lambda: _drained(d), 10, "arena back to zero")
        assert d.status()["transfers_by_transport"]["shm"] == "500"


def test_writer_blocked_on_a_full_arena_resumes_when_the_reader_reads(tmp_path: object) -> None:
    with running_daemon(
        str(tmp_path), "--grant-size", "1MiB", "--max-stage-bytes", "4MiB", pool="4MiB"
    ) as d:
        fits = int(d.pool()["capacity_bytes"]) // MiB
        writer = spawn_worker(
            ["stream-write", "--socket", d.socket, "--count", str(fits + 2), "--sizes", str(MiB),
             "--timeout", "60"]
        )  # fmt: skip
        assert writer.stdout is not None
        first = [writer.stdout.readline() for _ in range(fits)]
        assert all(len(line.split()) == 3 for line in first), first
        # Every byte of the arena is in DataRefs the writer has already handed
        # out; its next put waits for space.
        wait_until(
            lambda: d.status()["leases_by_state"].get("published") == str(fits),
            10,
            "the arena full of published chunks",
        )
        reader = spawn_worker(["stream-read", "--socket", d.socket, "--timeout", "60"])
        assert reader.stdin is not None and reader.stdout is not None
        assert reader.stdout.readline().strip() == b"READY"
        reader.stdin.write(first[0])
        reader.stdin.flush()
        assert reader.stdout.readline().decode().strip() == first[0].split()[1].decode()
        # One chunk read: the writer makes progress at once.
        nxt = writer.stdout.readline().split()
        assert len(nxt) == 3, nxt
        reader.stdin.writelines([*first[1:], b" ".join(nxt) + b"\n"])
        reader.stdin.flush()
        _, got = _pipe(writer, reader, window=1)
        assert got[-1] == "END"
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def test_error_signal_raises_stream_error_after_the_chunks_before_it(tmp_path: object) -> None:
    with running_daemon(str(tmp_path)) as d:
        writer = spawn_worker(
            ["stream-write", "--socket", d.socket, "--count", "10", "--error-at", "3",
             "--sizes", str(100 * KiB)]
        )  # fmt: skip
        reader = spawn_worker(["stream-read", "--socket", d.socket])
        assert reader.stdout is not None
        assert reader.stdout.readline().strip() == b"READY"
        expected, got = _pipe(writer, reader, window=4)
        assert len(expected) == 3
        assert got[:3] == expected
        assert got[3].startswith("ERR StreamError writer failed")
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def test_abort_mid_stream_frees_everything_and_unblocks_the_reader(tmp_path: object) -> None:
    async def abort(sock: str) -> int:
        async with RelayClient("thinker", sock) as c:
            return await c.abort("r")

    with running_daemon(str(tmp_path)) as d:
        writer = spawn_worker(
            ["stream-write", "--socket", d.socket, "--count", "10", "--sizes", str(MiB), "--hold"]
        )
        reader = spawn_worker(["stream-read", "--socket", d.socket, "--timeout", "60"])
        assert writer.stdout is not None and reader.stdin is not None and reader.stdout is not None
        assert reader.stdout.readline().strip() == b"READY"
        lines = [writer.stdout.readline() for _ in range(11)]
        assert lines[-1].split()[1] == b"DONE"
        # Half the chunks (not the first) and the done signal reach the reader:
        # it reads nothing yet and blocks waiting for chunk 0.
        reader.stdin.writelines([*lines[5:]])
        reader.stdin.flush()
        wait_until(lambda: d.status()["leases_by_state"].get("published") == "10", 10, "10 chunks")
        assert asyncio.run(asyncio.wait_for(abort(d.socket), 30)) == 10
        line = reader.stdout.readline().decode()
        assert line.startswith("ERR AbortedError"), line
        reader.stdin.close()
        assert reader.wait(timeout=30) == 0
        wait_until(lambda: _drained_published(d), 10, "every chunk freed")


def _drained_published(d: Daemon) -> bool:
    return int(d.pool().get("used_bytes", 0)) == 0


def test_streams_between_two_stages_in_one_process(tmp_path: object) -> None:
    async def scenario(sock: str) -> None:
        async with RelayClient("thinker", sock) as w, RelayClient("talker", sock) as r:
            chunks = [make_chunk(i, 64 * KiB) for i in range(20)]
            refs = [
                await w.put(c, to_stage="talker", request_id="s", chunk_id=i)
                for i, c in enumerate(chunks)
            ]
            refs.append(w.put_done("talker", "s"))
            for ref in reversed(refs):
                r.feed(ref)
            got = [c async for c in r.stream("s", from_stage="thinker", timeout=10)]
            assert [c is orig for c, orig in zip(got, chunks, strict=True)] == [True] * 20

            # the error signal arrives first; the chunk put before it is still yielded
            first = await w.put(make_chunk(0, 64 * KiB), to_stage="talker", request_id="e",
                                chunk_id=0)  # fmt: skip
            r.feed(w.put_error("talker", "e", "boom"))
            r.feed(first)
            seen = []
            with pytest.raises(StreamError, match="boom"):
                async for c in r.stream("e", from_stage="thinker", timeout=10):
                    seen.append(c)
            assert len(seen) == 1

            # abort wakes a reader blocked on a chunk that never comes
            async def consume() -> list[object]:
                return [c async for c in r.stream("a", from_stage="thinker")]

            task = asyncio.ensure_future(consume())
            r.feed(await w.put({"x": torch.ones(10_000)}, to_stage="talker", request_id="a",
                               chunk_id=1))  # fmt: skip
            await asyncio.sleep(0)
            assert not task.done()
            await w.abort("a")
            with pytest.raises(AbortedError):
                await asyncio.wait_for(task, 10)

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d.socket), 60))
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def test_inline_rule_applies_per_chunk(tmp_path: object) -> None:
    async def scenario(sock: str) -> None:
        async with RelayClient("thinker", sock) as w:
            small = await w.put({"tokens": [1, 2, 3]}, to_stage="x", request_id="i", chunk_id=0)
            assert small.transport.value == "inline"
            # a tensor in a chunk's payload travels with the chunk, never inline
            tiny = await w.put({"t": torch.ones(4)}, to_stage="x", request_id="i", chunk_id=1)
            assert tiny.transport.value == "shm"
            assert w.put_done("x", "i").chunk_id == 2
            await w.abort("i")

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d.socket), 60))


def test_an_abort_by_another_client_of_the_process_wakes_a_waiting_reader(
    tmp_path: object,
) -> None:
    """The daemon cannot tell a stream reader that holds no lease yet; the
    aborting client tells this process's other clients itself."""

    async def scenario(sock: str) -> None:
        async with RelayClient("thinker", sock) as w, RelayClient("talker", sock) as r:

            async def read() -> list[object]:
                return [c async for c in r.stream("doomed", from_stage="thinker", timeout=30)]

            task = asyncio.ensure_future(read())
            while not r._streams.has("doomed"):  # the reader is waiting
                await asyncio.sleep(0)
            assert await w.abort("doomed") == 0
            with pytest.raises(AbortedError):
                await asyncio.wait_for(task, 10)

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d.socket), 60))


def test_chunks_written_with_buffer_count_towards_the_done_signal(tmp_path: object) -> None:
    """put_done() without chunks= announces as many chunks as were put: those
    written in place with buffer() too. It counted only put()'s, so a reader
    following the done signal stopped before the buffer() chunks."""

    async def scenario(sock: str) -> None:
        async with RelayClient("thinker", sock) as w, RelayClient("talker", sock) as r:
            like = torch.empty(1000)
            for k in range(3):
                async with w.buffer(
                    to_stage="talker", request_id="b", like=like, chunk_id=k
                ) as out:
                    out.payload.fill_(k)
                r.feed(out.ref)
            done = w.put_done("talker", "b")
            assert done.proto.chunk_id == 3
            r.feed(done)
            got = [c async for c in r.stream("b", from_stage="thinker", timeout=10)]
            assert [int(c[0]) for c in got] == [0, 1, 2]
            for bad in (-1, 1.5):
                with pytest.raises(InvalidArgumentError, match="chunk_id must be"):
                    async with w.buffer(to_stage="talker", request_id="x", like=like,
                                        chunk_id=bad):  # type: ignore[arg-type]  # fmt: skip
                        pass

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d.socket), 60))
        wait_until(lambda: _drained(d), 10, "arena back to zero")


def test_an_aborted_stream_leaves_its_writer_no_chunk_count(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer counts each open stream's chunks for put_done's default; a stream
    that ends in an abort, its own or another stage's, must not stay counted."""
    import relayd_client._local

    # Two processes' worth: leased chunks, so the daemon tells the writer of the abort.
    monkeypatch.setattr(relayd_client._local, "serves", lambda stage: False)

    async def scenario(sock: str) -> None:
        async with RelayClient("thinker", sock) as w, RelayClient("talker", sock) as r:
            for rid in ("mine", "theirs", "open"):
                for i in range(3):
                    chunk = make_chunk(i, 64 * KiB)  # leased: the daemon knows the writer
                    await w.put(chunk, to_stage="talker", request_id=rid, chunk_id=i)
            assert {rid for _, rid in w._writer.chunks} == {"mine", "theirs", "open"}
            await w.abort("mine")
            await r.abort("theirs")  # reaches the writer as an aborted notice
            await async_wait_until(
                lambda: "theirs" not in {rid for _, rid in w._writer.chunks}, 10, "notice"
            )
            assert {rid for _, rid in w._writer.chunks} == {"open"}
            ref = w.put_done("talker", "open")
            assert ref.proto.chunk_id == 3  # the open stream's count is intact
            await w.abort("open")  # its chunks are read by nobody here

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d.socket), 60))
        wait_until(lambda: _drained(d), 10, "arena back to zero")
