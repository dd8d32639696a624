"""A session's FetchCall: answered inside the frame's handling when its push has
landed, ahead of the notices riding in the same frame; a bad one answers its
error and keeps the session; one that must wait runs as a task.

The reader of a cross-node DataRef waits for this answer and for nothing else,
so it must not wait for a loop turn or for the Release and reports its client
sent along.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from relayd_client.wire.errors import CorruptRefError
from relayd_client.wire.framing import LENGTH_BYTES, decode_frame, encode_frame, frame_length
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.pools.arena import Arena
from relayd.pools.leases import LeaseManager
from relayd.pools.sessions import Session
from relayd.rpc.admission import Admission
from relayd.rpc.fetch import Answer
from relayd.rpc.session import SessionHooks, SessionProtocol
from tests.unit.test_frame_counts import _manager, _session
from tests.unit.test_leases import arena

__all__ = ["arena"]  # the fixture, shared with test_leases

LEASE = pb.LeaseRef(pool="shm", segment=0, slot=3, nslots=1, offset=4096, length=10, lease_id=7)
ANSWER = pb.FetchResponse(lease=LEASE, node_id="b", daemon_epoch="e")


class _Socket:
    """The daemon's side of a session socket: the frames it wrote, decoded."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    def get_write_buffer_size(self) -> int:
        return 0  # all of it sent

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def frames(self) -> list[pb.SessionFrame]:
        out, pos = [], 0
        while pos < len(self.data):
            n = frame_length(self.data, pos)
            out.append(decode_frame(bytes(self.data[pos + LENGTH_BYTES : pos + LENGTH_BYTES + n])))
            pos += LENGTH_BYTES + n
        return out

    def results(self) -> list[pb.FetchResult]:
        return [r for f in self.frames() for r in f.fetched]


def _protocol(
    m: LeaseManager, s: Session, fetch: Callable[[Session, bytes, float], Answer]
) -> tuple[SessionProtocol, _Socket, list[str]]:
    seen: list[str] = []

    def fetched(session: Session, data: bytes, asked: float) -> Answer:
        seen.append("fetch")
        return fetch(session, data, asked)

    hooks = SessionHooks(report=lambda session, rep: seen.append("report"), fetch=fetched)
    p = SessionProtocol(m, Admission([0], [], daemon_uid=0), hooks)
    sock = _Socket()
    p.session, p.transport = s, sock  # type: ignore[assignment]
    return p, sock, seen


def _frame(call_id: int) -> bytes:
    """A reader's frame: a report lingering from earlier, then its fetch."""
    f = pb.SessionFrame()
    f.report.add(from_stage="a", to_stage="b", count=1, bytes=10)
    f.fetch.add(call_id=call_id, data_ref=b"ref", timeout_seconds=1.0)
    return encode_frame(f)


def test_a_landed_fetch_is_answered_within_its_frame_before_the_notices(arena: Arena) -> None:
    m = _manager(arena, lambda *a: None)
    p, sock, seen = _protocol(m, _session(m, ["b"]), lambda s, d, t: ANSWER)
    p.data_received(_frame(5))  # no loop runs: an answer that needed a task would not be here
    [result] = sock.results()
    assert result.call_id == 5 and result.response == ANSWER
    assert seen == ["fetch", "report"]
    assert not p._fetches and not sock.closed


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (CorruptRefError("bad ref"), pb.ERROR_CODE_CORRUPT_REF),
        (RuntimeError("a bug"), pb.ERROR_CODE_INTERNAL),
    ],
    ids=["bad ref", "bug"],
)
def test_a_fetch_that_fails_at_once_answers_its_error_and_keeps_the_session(
    arena: Arena, exc: Exception, code: int
) -> None:
    def fail(session: Session, data: bytes, asked: float) -> Answer:
        raise exc

    m = _manager(arena, lambda *a: None)
    p, sock, seen = _protocol(m, _session(m, ["b"]), fail)
    p.data_received(_frame(6))
    [result] = sock.results()
    assert result.call_id == 6 and result.code == code
    assert not result.HasField("response")
    assert seen == ["fetch", "report"] and not sock.closed and p.session is not None
    p.data_received(_frame(7))  # the session still serves fetches
    assert [r.call_id for r in sock.results()] == [6, 7]


def test_a_fetch_that_must_wait_is_answered_by_its_task(arena: Arena) -> None:
    async def main() -> None:
        landed = asyncio.get_running_loop().create_future()

        async def later() -> pb.FetchResponse:
            await landed
            return ANSWER

        m = _manager(arena, lambda *a: None)
        p, sock, _ = _protocol(m, _session(m, ["b"]), lambda s, d, t: later())
        p.data_received(_frame(8))
        assert not sock.results() and list(p._fetches) == [8]
        landed.set_result(None)
        await asyncio.wait_for(p._fetches[8], 5.0)
        [result] = sock.results()
        assert result.call_id == 8 and result.response == ANSWER
        assert not p._fetches

    asyncio.run(main())
