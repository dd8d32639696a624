"""A daemon's notice channels end with its peer layer: ``PeerNotifier.close`` returns
only once every connection is closed, one still being dialled among them (a
cancelled connect closes its socket as its task ends, not when it is told to)."""

from __future__ import annotations

import inspect
import pathlib
import types

import pytest

from relayd.transports.loopback import Loopback
from tests._daemon import async_wait_until, hanging_port
from tests.unit.test_peer_manager import Node, peer_token, run

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0


def test_close_ends_a_dial_still_connecting(tmp_path: pathlib.Path) -> None:
    token = peer_token(tmp_path)

    async def main() -> None:
        node = Node("a", Loopback(), token)
        with hanging_port() as port:
            try:
                await node.peers.start()
                notifier = node.peers.notifier
                peer = types.SimpleNamespace(  # a dial to it hangs
                    address=f"127.0.0.1:{port}", notice_port=port, epoch="e", up=True
                )
                notifier.ensure_channel(peer)  # type: ignore[arg-type]
                [dial] = notifier._dialling.values()
                await async_wait_until(
                    lambda: inspect.getcoroutinestate(dial.get_coro()) == inspect.CORO_SUSPENDED,
                    WAIT_S,
                    "the dial to be connecting",
                )
                assert not dial.done()
                await notifier.close()
                assert dial.cancelled()
            finally:
                await node.close()
                node.dispose()

    run(main())
