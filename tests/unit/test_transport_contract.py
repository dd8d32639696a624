"""The RemoteTransport contract, run against every backend in one process.

The loopback fake (``relayd.transports.loopback``) always; Mooncake where
``mooncake.engine`` imports (two engines in one process, P2P handshake on
loopback). The tests of the loopback's own knobs (fail, hold) follow.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import mmap
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest
from relayd_client.wire.errors import (
    InternalError,
    InvalidArgumentError,
    PeerUnavailableError,
    SessionClosedError,
)

from relayd.config import Settings
from relayd.transports import mooncake as mc
from relayd.transports.base import (
    MemoryRegion,
    PullFailedError,
    PullOp,
    PullTimeoutError,
    RemoteTransport,
    TransportState,
)
from relayd.transports.loopback import Loopback, LoopbackTransport
from tests._mooncake import requires_mooncake

PEER_TIMEOUT = 2.0
# No endpoint serves it: a closed port for Mooncake, an unknown id for the loopback.
UNREACHABLE = "127.0.0.1:1"
BOUND = 10.0  # every wait in these tests; a hang check, not a performance assertion

Pair = Callable[[], tuple[RemoteTransport, RemoteTransport]]


def _loopback_pair() -> tuple[RemoteTransport, RemoteTransport]:
    net = Loopback()
    return net.transport(), net.transport()


def _mooncake_pair() -> tuple[RemoteTransport, RemoteTransport]:
    settings = Settings(peer_address="127.0.0.1:0", peer_timeout=PEER_TIMEOUT)
    return mc.MooncakeTransport(settings), mc.MooncakeTransport(settings)


BACKENDS = [
    pytest.param(_loopback_pair, id="loopback"),
    pytest.param(
        _mooncake_pair,
        id="mooncake",
        marks=[
            pytest.mark.multinode,
            requires_mooncake,
        ],
    ),
]


@contextmanager
def _regions(*sizes: int) -> Iterator[list[tuple[mmap.mmap, MemoryRegion]]]:
    """Anonymous mappings as regions; the ctypes anchors live as long as the block."""
    bufs = [mmap.mmap(-1, size) for size in sizes]
    anchors = [ctypes.c_char.from_buffer(buf) for buf in bufs]
    try:
        yield [
            (buf, MemoryRegion(f"r{i}", ctypes.addressof(anchor), len(buf)))
            for i, (buf, anchor) in enumerate(zip(bufs, anchors, strict=True))
        ]
    finally:
        del anchors
        for buf in bufs:
            buf.close()


@asynccontextmanager
async def _open(pair: Pair) -> AsyncIterator[tuple[RemoteTransport, RemoteTransport]]:
    a, b = pair()
    async with a, b:
        yield a, b


def _sha(data: bytes | mmap.mmap) -> str:
    return hashlib.sha256(data).hexdigest()


def _run(coro: object) -> None:
    asyncio.run(asyncio.wait_for(coro, 60))  # type: ignore[arg-type]


@pytest.mark.parametrize("pair", BACKENDS)
def test_lifecycle_and_errors_in_one_process(pair: Pair) -> None:
    async def main() -> None:
        a, b = pair()
        with _regions(1 << 20, 1 << 20) as [(buf_a, reg_a), (buf_b, reg_b)]:
            with pytest.raises(SessionClosedError):
                _ = a.session_id
            async with a, b:
                assert a.state is TransportState.OPEN
                with pytest.raises(InternalError):
                    await a.start()
                assert a.session_id != b.session_id
                await a.register(reg_a)
                await b.register(reg_b)
                with pytest.raises(InvalidArgumentError):
                    await b.register(MemoryRegion("overlap", reg_b.base + 4096, 4096))
                buf_a[100:200] = bytes(range(100))
                await b.pull(a.session_id, [PullOp(reg_b.base, reg_a.base + 100, 100)], timeout=5)
                assert buf_b[:100] == bytes(range(100))
                await b.pull(a.session_id, [], timeout=5)  # nothing to do
                with pytest.raises(InvalidArgumentError):
                    await b.pull(a.session_id, [PullOp(reg_b.base, reg_a.base, 0)], timeout=5)
                with pytest.raises(InvalidArgumentError):
                    await b.pull(a.session_id, [(reg_b.base, reg_a.base)], timeout=5)  # type: ignore[list-item]
                started = time.monotonic()
                with pytest.raises(PullFailedError) as failed:
                    await b.pull(UNREACHABLE, [PullOp(reg_b.base, 4096, 10)], timeout=5)
                assert time.monotonic() - started < 3 * PEER_TIMEOUT
                assert failed.value.in_flight is False and failed.value.settled.done()
                assert isinstance(failed.value, PeerUnavailableError)
                await b.wait_settled([PullOp(reg_b.base, 0, 1 << 20)])
            assert a.state.name == "CLOSED"  # (mypy narrowed a.state to OPEN above)
            await a.close()  # idempotent
            with pytest.raises(SessionClosedError):
                await a.pull("x:1", [PullOp(reg_a.base, 1, 1)], timeout=1)

    _run(main())


@pytest.mark.parametrize("pair", BACKENDS)
def test_pull_and_push_are_byte_exact_and_unaligned(pair: Pair) -> None:
    async def main() -> None:
        with _regions(4 << 20, 4 << 20) as [(buf_a, reg_a), (buf_b, reg_b)]:
            async with _open(pair) as (a, b):
                await a.register(reg_a)
                await b.register(reg_b)
                n = (1 << 20) + 7
                buf_a[5 : 5 + n] = os.urandom(n)
                await b.pull(a.session_id, [PullOp(reg_b.base + 3, reg_a.base + 5, n)], timeout=5)
                assert _sha(buf_b[3 : 3 + n]) == _sha(buf_a[5 : 5 + n])
                buf_b[: 1 << 20] = os.urandom(1 << 20)
                ops = [
                    PullOp(reg_b.base + off, reg_a.base + (2 << 20) + off, 1 << 18)
                    for off in range(0, 1 << 20, 1 << 18)
                ]
                await b.push(a.session_id, ops, timeout=5)
                assert _sha(buf_a[2 << 20 : 3 << 20]) == _sha(buf_b[: 1 << 20])

    _run(main())


@pytest.mark.parametrize("pair", BACKENDS)
def test_then_lands_after_the_body_and_never_after_it_failed(pair: Pair) -> None:
    async def main() -> None:
        with _regions(1 << 20, 1 << 20) as [(buf_a, reg_a), (buf_b, reg_b)]:
            async with _open(pair) as (a, b):
                await a.register(reg_a)
                await b.register(reg_b)
                buf_a[:4096] = os.urandom(4096)
                body = [PullOp(reg_b.base, reg_a.base, 4080)]
                flag = [PullOp(reg_b.base + 8192, reg_a.base + 4080, 16)]
                await b.pull(a.session_id, body, timeout=5, then=flag)
                assert buf_b[:4080] + buf_b[8192 : 8192 + 16] == buf_a[:4096]
                # The body's remote range is registered nowhere: the flag is never read.
                buf_b[8192 : 8192 + 16] = bytes(16)
                outside = [PullOp(reg_b.base, reg_a.end - 10, 11)]
                with pytest.raises(PullFailedError) as failed:
                    await b.pull(a.session_id, outside, timeout=PEER_TIMEOUT, then=flag)
                assert failed.value.in_flight is False
                assert buf_b[8192 : 8192 + 16] == bytes(16)
                # The engine stays usable; a body-less pull is its "then" alone.
                await b.pull(a.session_id, [], timeout=5, then=flag)
                assert buf_b[8192 : 8192 + 16] == buf_a[4080:4096]

    _run(main())


@pytest.mark.parametrize("pair", BACKENDS)
def test_pull_from_a_closed_peer_fails_not_in_flight(pair: Pair) -> None:
    async def main() -> None:
        with _regions(1 << 20, 1 << 20) as [(_, reg_a), (_, reg_b)]:
            async with _open(pair) as (a, b):
                await a.register(reg_a)
                await b.register(reg_b)
                op = [PullOp(reg_b.base, reg_a.base, 4096)]
                await b.pull(a.session_id, op, timeout=5)  # warm
                gone = a.session_id
                await a.close()
                with pytest.raises(PullFailedError) as failed:
                    await b.pull(gone, op, timeout=PEER_TIMEOUT)
                assert failed.value.in_flight is False

    _run(main())


@pytest.mark.multinode
@requires_mooncake
def test_mooncake_pushes_to_a_reached_peer_and_a_submit_that_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pushes to a peer already reached are submitted by a worker that hands them to
    the watcher itself; a submit that raises there fails that push, in flight (its
    ops cannot be told apart from ones still writing), and the next push works."""

    async def main() -> None:
        with _regions(4 << 20, 4 << 20) as [(buf_a, reg_a), (buf_b, reg_b)]:
            async with _open(_mooncake_pair) as (a, b):
                await a.register(reg_a)
                await b.register(reg_b)
                await b.pull(a.session_id, [PullOp(reg_b.base, reg_a.base, 4096)], timeout=5)
                for i in range(8):  # one op and several, 4 KiB to 1 MiB
                    n, parts = 4096 << i % 9, 1 + i % 3
                    buf_b[:n] = os.urandom(n)
                    step = n // parts
                    ops = [
                        PullOp(reg_b.base + k * step, reg_a.base + (1 << 20) + k * step, step)
                        for k in range(parts)
                    ]
                    await b.push(a.session_id, ops, timeout=5)
                    got = buf_a[1 << 20 : (1 << 20) + step * parts]
                    assert _sha(got) == _sha(buf_b[: step * parts])

                real = mc.submit_blocking

                def broken(*args: object) -> object:
                    raise RuntimeError("the engine broke")

                monkeypatch.setattr(mc, "submit_blocking", broken)
                op = [PullOp(reg_b.base, reg_a.base, 4096)]
                with pytest.raises(PullFailedError) as failed:
                    await b.push(a.session_id, op, timeout=5)
                assert failed.value.in_flight is True
                assert "the engine broke" in failed.value.message
                monkeypatch.setattr(mc, "submit_blocking", real)
                buf_b[:4096] = os.urandom(4096)
                await b.push(a.session_id, op, timeout=5)
                assert _sha(buf_a[:4096]) == _sha(buf_b[:4096])

    _run(main())


# --- the loopback's knobs --------------------------------------------------------------


async def _loopback_with_regions() -> tuple[LoopbackTransport, LoopbackTransport]:
    net = Loopback()
    a, b = net.transport(), net.transport()
    await a.start()
    await b.start()
    return a, b


def test_fail_next_fails_that_many_transfers_then_works_again() -> None:
    async def main() -> None:
        with _regions(4096, 4096) as [(buf_a, reg_a), (buf_b, reg_b)]:
            a, b = await _loopback_with_regions()
            await a.register(reg_a)
            await b.register(reg_b)
            buf_a[:16] = b"x" * 16
            op = [PullOp(reg_b.base, reg_a.base, 16)]
            b.fail_next(2)
            for _ in range(2):
                with pytest.raises(PullFailedError) as failed:
                    await b.pull(a.session_id, op, timeout=1)
                assert failed.value.in_flight is False and failed.value.settled.done()
            assert buf_b[:16] == bytes(16)
            await b.pull(a.session_id, op, timeout=1)
            assert buf_b[:16] == b"x" * 16 and b.transfers == 1
            await a.close()
            await b.close()

    _run(main())


def test_a_held_pull_times_out_in_flight_and_lands_when_released() -> None:
    async def main() -> None:
        with _regions(4096, 4096) as [(buf_a, reg_a), (buf_b, reg_b)]:
            a, b = await _loopback_with_regions()
            await a.register(reg_a)
            await b.register(reg_b)
            buf_a[:16] = b"y" * 16
            op = [PullOp(reg_b.base, reg_a.base, 16)]
            gate = b.hold()
            with pytest.raises(PullTimeoutError) as late:
                await b.pull(a.session_id, op, timeout=0)
            await gate.entered(BOUND)
            assert late.value.in_flight is True and not late.value.settled.done()
            settled = asyncio.ensure_future(b.wait_settled(op))
            assert buf_b[:16] == bytes(16)
            gate.release()
            await asyncio.wait_for(late.value.settled, BOUND)
            await asyncio.wait_for(settled, BOUND)
            assert buf_b[:16] == b"y" * 16  # the late completion wrote, as Mooncake's would
            await a.close()
            await b.close()

    _run(main())


def test_a_held_pull_released_as_failed_or_closed_writes_nothing() -> None:
    async def main() -> None:
        with _regions(4096, 4096) as [(buf_a, reg_a), (buf_b, reg_b)]:
            a, b = await _loopback_with_regions()
            await a.register(reg_a)
            await b.register(reg_b)
            buf_a[:16] = b"z" * 16
            op = [PullOp(reg_b.base, reg_a.base, 16)]
            gate = b.hold()
            pull = asyncio.ensure_future(b.pull(a.session_id, op, timeout=BOUND))
            await gate.entered(BOUND)
            gate.release(fail=True)
            with pytest.raises(PullFailedError) as failed:
                await asyncio.wait_for(pull, BOUND)
            assert failed.value.in_flight is False
            # close() interrupts a held pull: it fails, and nothing writes afterwards.
            gate = b.hold()
            pull = asyncio.ensure_future(b.pull(a.session_id, op, timeout=BOUND))
            await gate.entered(BOUND)
            await b.close()
            with pytest.raises(PullFailedError, match="closed"):
                await asyncio.wait_for(pull, BOUND)
            await asyncio.wait_for(b.wait_settled(op), BOUND)
            assert buf_b[:16] == bytes(16)
            await a.close()

    _run(main())
