"""A stopping daemon closes every session connection, even one the loop had
accepted but not yet made: its protocol exists a step before ``connection_made``."""

from __future__ import annotations

import asyncio
import socket

from relayd.pools.arena import Arena
from relayd.pools.leases import LeaseManager
from relayd.rpc.admission import Admission
from relayd.rpc.session import SessionHooks, SessionProtocol
from tests.unit.test_leases import SLOT, Clock, arena

__all__ = ["arena"]  # the fixture, shared with test_leases

WAIT_S = 5.0


def _protocol(arena: Arena) -> SessionProtocol:
    m = LeaseManager(
        arena, grant_bytes=8 * SLOT, lease_ttl=10.0, stage_quota_bytes=24 * SLOT,
        max_sessions=8, clock=Clock(),
    )  # fmt: skip
    return SessionProtocol(m, Admission([0], [], daemon_uid=0), SessionHooks())


async def _accepted(protocol: SessionProtocol, theirs: socket.socket) -> asyncio.BaseTransport:
    """What the loop does with a socket it accepted: make ``protocol``'s connection."""
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_accepted_socket(lambda: protocol, theirs)
    return transport


async def _eof(sock: socket.socket) -> bool:
    """True once the daemon's end is closed, read on the loop (which closes it)."""
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    return await asyncio.wait_for(loop.sock_recv(sock, 1), WAIT_S) == b""


def test_a_connection_made_after_the_stop_is_closed_unserved(arena: Arena) -> None:
    async def main() -> None:
        protocol = _protocol(arena)
        protocol.stop()  # between the accept and connection_made
        ours, theirs = socket.socketpair()
        with ours:
            transport = await _accepted(protocol, theirs)
            assert transport.is_closing()
            assert protocol.transport is None and protocol._bind_timer is None
            assert await _eof(ours)

    asyncio.run(main())


def test_stopping_closes_a_connection_already_made(arena: Arena) -> None:
    async def main() -> None:
        protocol = _protocol(arena)
        ours, theirs = socket.socketpair()
        with ours:
            transport = await _accepted(protocol, theirs)
            assert not transport.is_closing()
            protocol.stop()
            assert transport.is_closing()
            assert await _eof(ours)

    asyncio.run(main())
