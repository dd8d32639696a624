"""The keepalive tests' TCP relay (:class:`tests._grpc_relay.Relay`) leaves nothing
open: a transport it left behind fails whichever later test of the worker the
garbage collector happens to find it in, as an unclosed-transport warning."""

from __future__ import annotations

import asyncio

import pytest

from tests._daemon import async_wait_until, hanging_port
from tests._grpc_relay import Relay

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0


def test_close_ends_a_connection_accepted_while_its_upstream_is_still_dialled() -> None:
    async def main() -> None:
        with hanging_port() as port:
            relay = Relay(f"127.0.0.1:{port}")  # its dial upstream hangs
            address, _, relay_port = (await relay.start()).rpartition(":")
            reader, writer = await asyncio.open_connection(address, int(relay_port))
            try:
                await async_wait_until(lambda: relay.accepted == 1, WAIT_S, "the accept")
                await relay.close()
                assert await asyncio.wait_for(reader.read(), WAIT_S) == b""  # ended
            finally:
                writer.close()
                await writer.wait_closed()

    asyncio.run(main())
