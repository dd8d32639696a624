"""A keyed put its writer cancelled is taken back: nothing is delivered that the writer
was told did not happen.

The writer's ``put(key=...)`` waits for its daemon to index the put (here or on
the consumer's node). When the writer's call is cancelled meanwhile (its task
cancelled, a blocking client's wait that ran out), its client tells the
daemon: a ``DiscardCall`` naming the key withdraws the put. The daemon ends a
hand-over still under way as a failed put (its lease freed, the peer asked to
take the key back), and takes a put it already indexed back out of the index
- here or on the peer - and frees its lease. A put whose key a reader took
first stands: the reader has the DataRef and may be reading it.

Real parts as in ``test_keyed_put_taken_back``: two peer layers, the daemon's
keyed calls, the writer node's real session socket, and the client's own
session channel and keyed put.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
from typing import Any

import pytest
from relayd_client import _keyed
from relayd_client.wire.dataref import DataRef
from relayd_client.wire.errors import PermissionDeniedError, StaleRefError
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.pools.sessions import Session
from relayd.rpc.keyed import KeyedCalls
from relayd.rpc.session import SessionProtocol
from tests.unit.test_keyed_put_answer_too_late import KEY, _poll, keyed_nodes, put_for_b
from tests.unit.test_keyed_put_answer_too_late import _keyed as keyed_calls
from tests.unit.test_keyed_put_session_deadline import (
    _connected,
    _index,
    _unbound,
    session_socket,
)
from tests.unit.test_keyed_put_taken_back import _answer_held, _put
from tests.unit.test_peer_manager import READER, SLOT, WRITER, Node, _sha, run, until

pytestmark = pytest.mark.timeout(60)

BOUND = 10.0  # no test waits this long unless the behaviour under test is broken


async def _cancelled(put: asyncio.Future[None]) -> None:
    """Cancel the writer's keyed put, as a task cancelled while it waits."""
    put.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(put, BOUND)


async def _settled(protocol: SessionProtocol) -> None:
    """The writer's node has ended every call of the session, and the client every call
    it made on its own after the cancel."""
    await until(
        lambda: not protocol._keyed and not _keyed._giving_back,
        "the writer's node and client to end their calls",
        BOUND,
    )


def test_a_keyed_put_cancelled_while_its_peer_is_asked_is_not_delivered(
    tmp_path: pathlib.Path,
) -> None:
    async def main() -> None:
        async with keyed_nodes(tmp_path) as (a, b, on_b):
            _writer, reader, ref = await put_for_b(a, b)
            # B indexes the put and answers; A hears it only after the writer's cancel.
            release = _answer_held(a)
            path = tmp_path / "a.sock"
            async with session_socket(a, keyed_calls(a), path) as protocols:
                session = _unbound(a, WRITER)
                channel = await _connected(path, session)
                try:
                    put = asyncio.ensure_future(_index(channel, ref, BOUND))
                    await until(lambda: len(on_b.keys) == 1, "B to index the put", BOUND)
                    await _cancelled(put)
                    await until(
                        lambda: len(on_b.keys) == 0,
                        "B to drop the key of a put its writer cancelled",
                        BOUND,
                    )
                    [protocol] = protocols
                    await _settled(protocol)
                    assert not a.leases.leases, "A kept the lease of a put its writer cancelled"
                    # The writer's retry of the key is delivered, and read.
                    data = os.urandom(SLOT + 5)
                    await _index(channel, await a.put(session, data), BOUND)
                    wire = await on_b.take(reader, _poll(KEY))
                    assert wire, "the writer's retry of the key was not indexed"
                    local = await asyncio.wait_for(b.peers.fetch(reader, wire, BOUND), BOUND)
                    assert _sha(b.read(local)) == _sha(data)
                finally:
                    release.set()
                    await channel.close()

    run(main())


def test_a_withdrawn_put_the_peer_indexed_already_is_taken_out_there(
    tmp_path: pathlib.Path,
) -> None:
    """The writer's withdrawal reaches its daemon after the hand-over ended: the key is
    taken out of the peer's index, and the lease freed."""

    async def main() -> None:
        async with keyed_nodes(tmp_path) as (a, b, on_b):
            writer, reader, ref = await put_for_b(a, b)
            on_a = keyed_calls(a)
            await on_a.put(writer, _put(ref))
            assert len(on_b.keys) == 1 and len(a.leases.leases) == 1
            await on_a.discard(writer, _withdraw(ref))
            assert len(on_b.keys) == 0, "B kept the key of a put its writer withdrew"
            assert not a.leases.leases, "A kept the lease of a put its writer withdrew"
            assert await on_b.take(reader, _poll(KEY)) == b""
            # Nothing left to withdraw a second time.
            with pytest.raises(StaleRefError):
                await on_a.discard(writer, _withdraw(ref))

    run(main())


async def _here(a: Node) -> tuple[Session, KeyedCalls]:
    """A reader of the put's stage on A itself, and A's keyed calls: keys for it are
    indexed on A."""
    reader = a.session(READER)
    return reader, keyed_calls(a)


def _read_here(a: Node, wire: bytes) -> bytes:
    return a.read(DataRef.from_bytes(wire).proto.lease)


def test_a_keyed_put_cancelled_as_it_is_sent_is_not_indexed(tmp_path: pathlib.Path) -> None:
    async def main() -> None:
        async with keyed_nodes(tmp_path) as (a, _b, _on_b):
            reader, on_a = await _here(a)
            path = tmp_path / "a.sock"
            async with session_socket(a, on_a, path) as protocols:
                session = _unbound(a, WRITER)
                channel = await _connected(path, session)
                try:
                    ref = await a.put(session, os.urandom(SLOT))
                    put = asyncio.ensure_future(_index(channel, ref, BOUND))
                    await asyncio.sleep(0)  # its first step: the KeyedPut goes
                    assert channel._keyed, "the writer's put did not send its KeyedPut"
                    await _cancelled(put)
                    [protocol] = protocols
                    await _settled(protocol)
                    assert len(on_a.keys) == 0, "A indexed a put its writer cancelled"
                    assert not a.leases.leases, "A kept the lease of a put its writer cancelled"
                    data = os.urandom(SLOT + 9)
                    await _index(channel, await a.put(session, data), BOUND)
                    wire = await on_a.take(reader, _poll(KEY))
                    assert wire and _sha(_read_here(a, wire)) == _sha(data)
                finally:
                    await channel.close()

    run(main())


def _take_back_held(node: Node) -> tuple[asyncio.Event, asyncio.Event]:
    """``node``'s next Peer KeyedWithdraw waits before it goes out: the first event is
    set once it waits, and it goes once the second is set."""
    links = node.peers.links
    call = links.call
    asked, release = asyncio.Event(), asyncio.Event()

    async def held(peer: Any, rpc: str, request: Any, *args: Any, **kw: Any) -> Any:
        if rpc == "KeyedWithdraw" and not asked.is_set():
            asked.set()
            await release.wait()
        return await call(peer, rpc, request, *args, **kw)

    links.call = held  # type: ignore[method-assign]
    return asked, release


def test_a_withdrawal_is_answered_once_the_peer_took_the_key_back(
    tmp_path: pathlib.Path,
) -> None:
    """Withdrawn while the peer is asked: the writer hears its withdrawal ended only once
    the peer has taken back the key it indexed, so a reader that polls next finds none."""

    async def main() -> None:
        async with keyed_nodes(tmp_path) as (a, b, on_b):
            writer, reader, ref = await put_for_b(a, b)
            answer = _answer_held(a)
            asked, release = _take_back_held(a)
            on_a = keyed_calls(a)
            put = asyncio.ensure_future(on_a.put(writer, _put(ref)))
            try:
                await until(lambda: len(on_b.keys) == 1, "B to index the put", BOUND)
                withdrawal = asyncio.ensure_future(on_a.discard(writer, _withdraw(ref)))
                await asyncio.wait_for(asked.wait(), BOUND)
                assert not withdrawal.done(), (
                    "the withdrawal was answered before the peer took the key back"
                )
            finally:
                release.set()
                answer.set()
            await asyncio.wait_for(withdrawal, BOUND)
            assert await on_b.take(reader, _poll(KEY)) == b"", (
                "a reader found the key of a put whose withdrawal its writer heard end"
            )
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(put, BOUND)
            assert not a.leases.leases, "A kept the lease of a put its writer withdrew"

    run(main())


def _withdraw(ref: bytes, key: str = KEY) -> pb.DiscardCall:
    return pb.DiscardCall(call_id=2, data_ref=ref, key=key)


def test_a_put_whose_key_a_reader_took_first_stands(tmp_path: pathlib.Path) -> None:
    """The race a cancel cannot undo: the reader has the DataRef, its lease stays."""

    async def main() -> None:
        async with keyed_nodes(tmp_path) as (a, _b, _on_b):
            reader, on_a = await _here(a)
            writer = a.session(WRITER)
            data = os.urandom(SLOT)
            ref = await a.put(writer, data)
            await on_a.put(writer, _put(ref))
            wire = await on_a.take(reader, _poll(KEY))
            with pytest.raises(StaleRefError):
                await on_a.discard(writer, _withdraw(ref))
            assert len(a.leases.leases) == 1
            assert _sha(_read_here(a, wire)) == _sha(data)

    run(main())


def test_only_the_writers_stage_withdraws_its_keyed_put(tmp_path: pathlib.Path) -> None:
    async def main() -> None:
        async with keyed_nodes(tmp_path) as (a, _b, _on_b):
            reader, on_a = await _here(a)
            writer = a.session(WRITER)
            ref = await a.put(writer, os.urandom(SLOT))
            await on_a.put(writer, _put(ref))
            with pytest.raises(PermissionDeniedError):
                await on_a.discard(reader, _withdraw(ref))
            assert len(on_a.keys) == 1 and len(a.leases.leases) == 1
            # The writer's own, under another key: not this put.
            with pytest.raises(StaleRefError):
                await on_a.discard(writer, _withdraw(ref, KEY + "x"))
            assert len(on_a.keys) == 1 and len(a.leases.leases) == 1
            await on_a.discard(writer, _withdraw(ref))
            assert len(on_a.keys) == 0 and not a.leases.leases
            assert await on_a.take(reader, _poll(KEY)) == b""

    run(main())


def test_a_forged_withdrawal_cannot_end_another_stages_hand_over(tmp_path: pathlib.Path) -> None:
    """A DataRef is its holder's to fill: one naming another stage's lease, claimed as
    the session's own stage's, finds no put of that stage to end."""

    async def main() -> None:
        async with keyed_nodes(tmp_path) as (a, b, on_b):
            writer, _reader, ref = await put_for_b(a, b)
            intruder = a.session("vocoder")
            release = _answer_held(a)
            on_a = keyed_calls(a)
            put = asyncio.ensure_future(on_a.put(writer, _put(ref)))
            try:
                await until(lambda: len(on_b.keys) == 1, "B to index the put", BOUND)
                m = pb.DataRef()
                m.CopyFrom(DataRef.from_bytes(ref).proto)
                m.origin.stage = "vocoder"
                with pytest.raises(StaleRefError):
                    await on_a.discard(intruder, _withdraw(DataRef(m).to_bytes()))
                assert not put.done(), "a forged withdrawal ended the writer's hand-over"
            finally:
                release.set()
            await asyncio.wait_for(put, BOUND)
            assert len(on_b.keys) == 1 and len(a.leases.leases) == 1

    run(main())


def test_a_withdrawn_put_pushed_to_the_peer_leaves_no_copy_there(tmp_path: pathlib.Path) -> None:
    """Its bytes landed on the reader's node (the writer's lease freed on landing): taken
    back, the key goes, and the landed copy with it rather than at its TTL."""

    async def main() -> None:
        async with keyed_nodes(tmp_path, push_grant_size=16 * SLOT) as (a, b, on_b):
            writer, reader = a.session(WRITER), b.session(READER)
            await until(lambda: b.address in a.peers.push.out, "A to hold B's push grant")
            await until(lambda: a.peers.serving(READER) is not None, "A to hear B's stages")
            ref = await a.put(writer, os.urandom(2 * SLOT + 5), push=True)
            await until(lambda: b.peers.push.counts[a.address].into == 1, "the push to land")
            await until(lambda: not a.leases.leases, "the writer's lease freed on landing")
            on_a = keyed_calls(a)
            await on_a.put(writer, _put(ref))
            assert len(on_b.keys) == 1 and len(b.leases.leases) == 1
            await on_a.discard(writer, _withdraw(ref))
            assert len(on_b.keys) == 0, "B kept the key of a put its writer withdrew"
            assert not b.leases.leases, "B kept the pushed copy of a put taken back"
            assert await on_b.take(reader, _poll(KEY)) == b""

    run(main())
