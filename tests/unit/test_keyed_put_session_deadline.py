"""A keyed put on the session socket that its writer stopped waiting for leaves nothing behind.

The writer's client sends a ``KeyedPut`` and waits its timeout (and a grace)
for the answer; its daemon hands a put for a stage served on another node to
that node with a Peer ``KeyedPut``, bounded by the peer timeout, which may be
longer. When the writer stops waiting first - it gave up, or its session
connection went - it has been told the put failed ("a failed keyed put leaves
nothing behind"), so its daemon must not go on to index the key and keep the
put's lease: the writer's retry of the key would be refused, and a lease nobody
holds a DataRef of would stay until its TTL.

Two real peer layers in one process (``test_peer_manager``), each with the
daemon's keyed calls and key index (``test_keyed_put_answer_too_late``); the
writer's node serves its real session protocol on a real Unix socket, and the
writer is the client's own session channel and keyed put - on its own thread
and loop where the daemon's loop is held, so that its timeout runs meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from relayd_client import _keyed, _session
from relayd_client._session import SessionChannel
from relayd_client.wire.dataref import DataRef
from relayd_client.wire.errors import DaemonUnavailableError, RelayError, RelayTimeoutError

from relayd.config import Settings
from relayd.pools.sessions import Session
from relayd.rpc.admission import Admission
from relayd.rpc.keyed import KeyedCalls
from relayd.rpc.session import SessionHooks, SessionProtocol
from tests.unit.test_keyed_put_answer_too_late import KEY, _poll, keyed_nodes, put_for_b
from tests.unit.test_keyed_put_answer_too_late import _keyed as keyed_calls
from tests.unit.test_peer_manager import WRITER, Node, run, until

pytestmark = pytest.mark.timeout(60)

BOUND = 10.0  # no test waits this long unless the behaviour under test is broken
# The writer's timeout, and the daemon's default peer timeout: a Peer call may
# outlast the writer's wait (its timeout and its client's grace).
WRITER_TIMEOUT = 0.5
PEER_TIMEOUT = Settings().peer_timeout
POLL_S = 0.01


@asynccontextmanager
async def session_socket(
    node: Node, keyed: KeyedCalls, path: pathlib.Path
) -> AsyncIterator[list[SessionProtocol]]:
    """``node``'s session socket at ``path``, served as the daemon serves it, with
    ``keyed`` for its keyed calls; yields the connections' protocols."""
    protocols: list[SessionProtocol] = []
    uid = os.getuid()

    def connection() -> SessionProtocol:
        protocol = SessionProtocol(
            node.leases, Admission([uid], [], daemon_uid=uid), SessionHooks(), keyed=keyed
        )
        protocols.append(protocol)
        return protocol

    server = await asyncio.get_running_loop().create_unix_server(connection, path=str(path))
    try:
        yield protocols
    finally:
        server.close()
        for protocol in protocols:
            if protocol.transport is not None:
                protocol.transport.close()
        await server.wait_closed()


def _unbound(node: Node, stage: str) -> Session:
    """A session attached and not bound yet: its client binds it on the session socket."""
    return node.leases.open_session(pid=os.getpid(), stages=[stage])


async def _connected(path: pathlib.Path, session: Session) -> SessionChannel:
    channel = SessionChannel(lambda frame: None, lambda: None)
    await channel.connect(str(path), session.id, session.token, BOUND)
    return channel


def _index(channel: SessionChannel, ref: bytes, timeout: float) -> Any:
    """The client's keyed put of ``ref`` under :data:`KEY` (after its publish)."""
    return _keyed.index(SimpleNamespace(session=channel), DataRef.from_bytes(ref), KEY, timeout)


class Writer:
    """The writer's client on its own thread and loop, once started: one keyed put, then
    its session stays open (a client that goes on) until :meth:`leave`."""

    def __init__(
        self, path: pathlib.Path, session: Session, ref: bytes, timeout: float = WRITER_TIMEOUT
    ) -> None:
        self.path, self.session, self.ref, self.timeout = path, session, ref, timeout
        self.outcome: list[RelayError | None] = []
        self.took = 0.0
        self.ended = threading.Event()  # the put was answered, or given up
        self._leave = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self) -> None:
        self.thread.start()

    async def _main(self) -> None:
        channel = await _connected(self.path, self.session)
        try:
            start = time.monotonic()
            try:
                await _index(channel, self.ref, self.timeout)
                self.outcome.append(None)
            except RelayError as exc:
                self.outcome.append(exc)
            finally:
                self.took = time.monotonic() - start
                self.ended.set()
            await asyncio.to_thread(self._leave.wait, BOUND)
        finally:
            await channel.close()

    def leave(self) -> None:
        self._leave.set()
        if self.thread.is_alive():
            self.thread.join(BOUND)


def _stalled(node: Node, writer: Writer) -> None:
    """``node``'s loop (the test's only loop), busy from the arrival of a Peer KeyedPut
    until that call's deadline has passed or the writer's put has ended (answered, or
    given up)."""
    links = node.peers.links
    authenticate = links.authenticate

    def stalled(context: Any, what: str) -> None:
        if what == "keyed put":
            busy_until = time.monotonic() + BOUND
            while (
                context.time_remaining() > 0
                and not writer.ended.wait(POLL_S)
                and time.monotonic() < busy_until
            ):
                pass
        authenticate(context, what)

    links.authenticate = stalled  # type: ignore[method-assign]


def _never_answered(node: Node) -> asyncio.Event:
    """``node``'s Peer KeyedPut calls, held before they go out until cancelled: a
    consumer's node that does not answer. The event: one was asked."""
    links = node.peers.links
    call = links.call
    asked = asyncio.Event()

    async def held(peer: Any, rpc: str, request: Any, *args: Any, **kw: Any) -> Any:
        if rpc == "KeyedPut":
            asked.set()
            await asyncio.Event().wait()
        return await call(peer, rpc, request, *args, **kw)

    links.call = held  # type: ignore[method-assign]
    return asked


# 0: a put that asked not to wait still waits its answer's grace.
@pytest.mark.parametrize("timeout", [WRITER_TIMEOUT, 0.0])
def test_a_keyed_put_whose_writer_gave_up_is_neither_indexed_nor_kept(
    tmp_path: pathlib.Path, timeout: float
) -> None:
    # Else the Peer call's own deadline would end the put before the writer gives up.
    assert timeout + _session._ANSWER_GRACE < PEER_TIMEOUT

    async def main() -> None:
        async with keyed_nodes(tmp_path, peer_timeout=PEER_TIMEOUT) as (a, b, on_b):
            _writer, reader, ref = await put_for_b(a, b)
            path = tmp_path / "a.sock"
            async with session_socket(a, keyed_calls(a), path) as protocols:
                writer = Writer(path, _unbound(a, WRITER), ref, timeout)
                _stalled(b, writer)
                writer.start()
                try:
                    await until(writer.ended.is_set, "the writer's put to end", BOUND)
                    [protocol] = protocols
                    await until(lambda: not protocol._keyed, "A to end the put", BOUND)
                    [err] = writer.outcome
                    assert isinstance(err, RelayTimeoutError), err
                    assert not a.leases.leases, (
                        "the writer's node kept the lease of a keyed put its writer was told failed"
                    )
                    assert len(on_b.keys) == 0, (
                        "the reader's node indexed a keyed put its writer was told failed"
                    )
                    assert await on_b.take(reader, _poll(KEY)) == b""
                    # Refused by the writer's daemon within the writer's wait, not
                    # given up on by the writer itself.
                    assert writer.took < timeout + _session._ANSWER_GRACE, err
                finally:
                    writer.leave()

    run(main())


def test_a_keyed_put_handed_over_within_its_writers_timeout_is_indexed(
    tmp_path: pathlib.Path,
) -> None:
    async def main() -> None:
        async with keyed_nodes(tmp_path, peer_timeout=PEER_TIMEOUT) as (a, b, on_b):
            _writer, reader, ref = await put_for_b(a, b)
            path = tmp_path / "a.sock"
            async with session_socket(a, keyed_calls(a), path):
                writer = Writer(path, _unbound(a, WRITER), ref)
                writer.start()
                try:
                    await until(writer.ended.is_set, "the writer's put to end", BOUND)
                    assert writer.outcome == [None]
                    assert len(a.leases.leases) == 1  # held for the reader, who finds it by key
                    assert await on_b.take(reader, _poll(KEY)) != b""
                finally:
                    writer.leave()

    run(main())


def test_a_keyed_put_whose_session_went_while_a_peer_was_asked_frees_its_lease(
    tmp_path: pathlib.Path,
) -> None:
    async def main() -> None:
        async with keyed_nodes(tmp_path) as (a, b, on_b):
            _writer, _reader, ref = await put_for_b(a, b)
            path = tmp_path / "a.sock"
            asked = _never_answered(a)
            async with session_socket(a, keyed_calls(a), path) as protocols:
                channel = await _connected(path, _unbound(a, WRITER))
                put = asyncio.ensure_future(_index(channel, ref, BOUND))
                await until(asked.is_set, "A to ask B to index the put", BOUND)
                [protocol] = protocols
                [handing_over] = protocol._keyed.values()
                await channel.close()  # the writer's session goes (its process ended, say)
                with pytest.raises(DaemonUnavailableError):
                    await asyncio.wait_for(put, BOUND)
                await asyncio.wait_for(asyncio.wait({handing_over}), BOUND)
                assert not a.leases.leases, (
                    "the writer's node kept the lease of a keyed put whose session went "
                    "before it was indexed"
                )
                assert len(on_b.keys) == 0

    run(main())
