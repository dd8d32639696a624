"""A keyed put the consumer's node indexed after its writer's daemon gave up is taken back.

The writer's daemon hands a keyed put for a stage served on another node to
that node with a Peer ``KeyedPut``. When it gives up on that call without a
clean answer - the answer came after its deadline, or the writer's session
went while the call was out - the consumer's node may have indexed the key
all the same. The writer was told the put failed and its lease was freed, so
that entry would hand a reader a freed lease (StaleRefError) and refuse the
writer's retry of the key (KeyExistsError) until it expired. The writer's
daemon asks the consumer's node to take the entry back (``Peer.KeyedWithdraw``),
which removes it only if it still names that very put's lease.

Two real peer layers in one process (``test_peer_manager``), each with the
daemon's keyed calls and key index (``test_keyed_put_answer_too_late``); the
writer's session, where one takes part, is the client's own session channel
on the writer node's real session socket (``test_keyed_put_session_deadline``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import time
from typing import Any

import grpc
import pytest
from relayd_client.wire.dataref import DataRef
from relayd_client.wire.errors import (
    DaemonUnavailableError,
    InvalidArgumentError,
    PermissionDeniedError,
    RelayError,
    RelayTimeoutError,
    StaleRefError,
)
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.status import from_rpc_error

from relayd.pools.sessions import Session
from relayd.rpc.keyed import KeyedCalls
from relayd.rpc.peer_service import PeerService
from tests.unit.test_keyed_put_answer_too_late import KEY, _poll, keyed_nodes, put_for_b
from tests.unit.test_keyed_put_answer_too_late import _keyed as keyed_calls
from tests.unit.test_keyed_put_session_deadline import (
    _connected,
    _index,
    _unbound,
    session_socket,
)
from tests.unit.test_peer_manager import SLOT, WRITER, Node, _sha, run, until

pytestmark = pytest.mark.timeout(60)

BOUND = 10.0  # no test waits this long unless the behaviour under test is broken
WRITER_TIMEOUT = 0.5
# The caller's own deadline may fall this much after the server's.
CALLER_SLACK = 0.2


def _answers_too_late(node: Node, on_node: KeyedCalls) -> None:
    """``node`` indexes the next Peer KeyedPut in time by its own clock, then its loop
    stays busy until that call's deadline has passed, and its caller's with it: the
    caller hears DEADLINE_EXCEEDED for a put that is indexed here."""
    links = node.peers.links
    authenticate = links.authenticate
    calls: list[Any] = []
    stalled = [False]

    def noted(context: Any, what: str) -> None:
        authenticate(context, what)
        if what == "keyed put" and not stalled[0]:
            stalled[0] = True
            calls.append(context)

    links.authenticate = noted  # type: ignore[method-assign]
    keys = on_node.keys
    add = keys.add

    def add_then_stall(ref: DataRef, key: str) -> None:
        add(ref, key)
        if calls:
            context = calls.pop()
            busy_until = time.monotonic() + BOUND
            while context.time_remaining() > 0 and time.monotonic() < busy_until:
                time.sleep(0.01)
            time.sleep(CALLER_SLACK)

    keys.add = add_then_stall  # type: ignore[method-assign]


def _answer_held(node: Node) -> asyncio.Event:
    """``node``'s next Peer KeyedPut goes out and is answered, but its answer reaches the
    caller only once the event is set (or never, if the caller is cancelled first)."""
    links = node.peers.links
    call = links.call
    release = asyncio.Event()
    held = [False]

    async def answer_held(peer: Any, rpc: str, request: Any, *args: Any, **kw: Any) -> Any:
        answer = await call(peer, rpc, request, *args, **kw)
        if rpc == "KeyedPut" and not held[0]:
            held[0] = True
            await release.wait()
        return answer

    links.call = answer_held  # type: ignore[method-assign]
    return release


def _put(ref: bytes, timeout: float = 0.0) -> pb.KeyedPut:
    return pb.KeyedPut(call_id=1, key=KEY, data_ref=ref, timeout_seconds=timeout)


async def _retry_is_read(
    a: Node, b: Node, writer: Session, reader: Session, on_b: KeyedCalls
) -> None:
    """The writer's retry of :data:`KEY` is indexed on B, and B's reader reads its bytes."""
    data = os.urandom(SLOT + 17)
    ref = await a.put(writer, data)
    await keyed_calls(a).put(writer, _put(ref))
    wire = await on_b.take(reader, _poll(KEY))
    assert wire, "the writer's retry of the key was not indexed"
    local = await asyncio.wait_for(b.peers.fetch(reader, wire, BOUND), BOUND)
    assert _sha(b.read(local)) == _sha(data), "the reader did not read the retry's bytes"


def test_a_keyed_put_indexed_by_the_peer_whose_answer_came_too_late_is_taken_back(
    tmp_path: pathlib.Path,
) -> None:
    async def main() -> None:
        async with keyed_nodes(tmp_path) as (a, b, on_b):
            writer, reader, ref = await put_for_b(a, b)
            _answers_too_late(b, on_b)
            with pytest.raises(RelayTimeoutError):
                await keyed_calls(a).put(writer, _put(ref, WRITER_TIMEOUT))
            assert not a.leases.leases  # the writer was told the put failed: its lease went
            await until(
                lambda: len(on_b.keys) == 0,
                "B to drop the key of a put whose writer was told it failed",
                BOUND,
            )
            await _retry_is_read(a, b, writer, reader, on_b)

    run(main())


def test_a_keyed_put_whose_session_went_after_the_peer_indexed_it_is_taken_back(
    tmp_path: pathlib.Path,
) -> None:
    async def main() -> None:
        async with keyed_nodes(tmp_path) as (a, b, on_b):
            writer, reader, ref = await put_for_b(a, b)
            release = _answer_held(a)
            path = tmp_path / "a.sock"
            async with session_socket(a, keyed_calls(a), path) as protocols:
                channel = await _connected(path, _unbound(a, WRITER))
                put = asyncio.ensure_future(_index(channel, ref, BOUND))
                await until(lambda: len(on_b.keys) == 1, "B to index the put", BOUND)
                [protocol] = protocols
                [handing_over] = protocol._keyed.values()
                await channel.close()  # the writer's session goes before A hears B's yes
                with pytest.raises(DaemonUnavailableError):
                    await asyncio.wait_for(put, BOUND)
                await asyncio.wait_for(asyncio.wait({handing_over}), BOUND)
                release.set()
                assert not a.leases.leases
                await until(
                    lambda: len(on_b.keys) == 0,
                    "B to drop the key of a put whose writer's session went before it was told",
                    BOUND,
                )
            await _retry_is_read(a, b, writer, reader, on_b)

    run(main())


async def _unimplemented(self: PeerService, request: Any, context: Any) -> Any:
    """What a peer that predates ``KeyedWithdraw`` answers."""
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")


def test_a_peer_without_the_take_back_call_leaves_the_put_failed_and_it_is_logged(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(PeerService, "KeyedWithdraw", _unimplemented, raising=False)
    caplog.set_level(logging.WARNING, logger="relayd.peers")

    def logged() -> list[str]:
        return [r.getMessage() for r in caplog.records if "not taken back" in r.getMessage()]

    async def main() -> None:
        async with keyed_nodes(tmp_path) as (a, b, on_b):
            writer, _reader, ref = await put_for_b(a, b)
            _answers_too_late(b, on_b)
            with pytest.raises(RelayTimeoutError):
                await keyed_calls(a).put(writer, _put(ref, WRITER_TIMEOUT))
            assert not a.leases.leases
            await until(logged, "A to log that B did not take the key back", BOUND)
            # What an older peer keeps: until its reader's read (StaleRefError) or its TTL.
            assert len(on_b.keys) == 1

    run(main())
    [line] = logged()
    assert "UNIMPLEMENTED" in line or "predates" in line, line


async def _withdraw(
    a: Node, b: Node, ref: bytes, *, key: str = KEY, node_id: str | None = None
) -> bool | RelayError:
    """A's ``Peer.KeyedWithdraw`` of ``ref`` under ``key`` at B: B's answer."""
    peer = a.peers.links.peers[b.address]
    request = pb.PeerKeyedWithdrawRequest(
        node_id=a.settings.node_id if node_id is None else node_id, key=key, data_ref=ref
    )
    try:
        resp = await a.peers.links.call(peer, "KeyedWithdraw", request)
    except grpc.RpcError as exc:
        return from_rpc_error(exc)
    return bool(resp.withdrawn)


def _altered(ref: bytes, **fields: Any) -> bytes:
    """``ref`` with its lease's or origin's ``fields`` changed, as a peer may send it."""
    m = pb.DataRef()
    m.CopyFrom(DataRef.from_bytes(ref).proto)
    for name, value in fields.items():
        part, attr = name.split("__")
        setattr(getattr(m, part), attr, value)
    return DataRef(m).to_v1_bytes()


def test_a_peer_takes_back_only_the_entry_of_that_very_put_of_its_own_node(
    tmp_path: pathlib.Path,
) -> None:
    async def main() -> None:
        async with keyed_nodes(tmp_path) as (a, b, on_b):
            writer, reader, ref = await put_for_b(a, b)
            await keyed_calls(a).put(writer, _put(ref))
            assert len(on_b.keys) == 1
            m = DataRef.from_bytes(ref).proto
            # Another put of the same key (another lease, generation or daemon run).
            assert (
                await _withdraw(a, b, _altered(ref, lease__generation=m.lease.generation + 1))
                is False
            )
            assert (
                await _withdraw(a, b, _altered(ref, lease__lease_id=m.lease.lease_id + 1)) is False
            )
            assert await _withdraw(a, b, _altered(ref, origin__daemon_epoch="0" * 8)) is False
            assert await _withdraw(a, b, ref, key=KEY + "x") is False
            # Another node's put, named by a peer: not its own to take back.
            other = _altered(ref, origin__node_id="unit-c")
            assert isinstance(await _withdraw(a, b, other), PermissionDeniedError)
            # A node that is not a connected peer, however it holds the token.
            stranger = await _withdraw(a, b, ref, node_id="unit-c")
            assert isinstance(stranger, PermissionDeniedError)
            # A key no put may have, checked as a put's is.
            assert isinstance(await _withdraw(a, b, ref, key=""), InvalidArgumentError)
            assert len(on_b.keys) == 1, "B dropped an entry it was not asked for"
            # That put, by its own node: taken back, once.
            assert await _withdraw(a, b, ref) is True
            assert len(on_b.keys) == 0
            assert await _withdraw(a, b, ref) is False
            # Nothing is left of it: no tombstone makes a reader's poll fail.
            assert await on_b.take(reader, _poll(KEY)) == b""

    run(main())


def test_a_take_back_that_overtakes_its_hand_over_keeps_that_put_out(
    tmp_path: pathlib.Path,
) -> None:
    """A cancelled hand-over's request may reach the consumer's node after the take-back
    that follows it: that put is refused then, and a retry of the key is not."""

    async def main() -> None:
        async with keyed_nodes(tmp_path) as (a, b, on_b):
            writer, reader, ref = await put_for_b(a, b)
            wire = DataRef.from_bytes(ref).to_v1_bytes()
            node = a.settings.node_id
            assert on_b.withdraw_from_peer(node, KEY, wire) is False  # nothing there yet
            with pytest.raises(StaleRefError):
                on_b.put_from_peer(node, KEY, wire)  # the overtaken hand-over
            assert len(on_b.keys) == 0
            assert await on_b.take(reader, _poll(KEY)) == b""
            await _retry_is_read(a, b, writer, reader, on_b)

    run(main())
