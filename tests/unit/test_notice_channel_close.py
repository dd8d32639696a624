"""A daemon's notice channels end with its peer layer: ``PeerNotifier.close`` returns
only once every connection is closed, one still being dialled among them (a
cancelled connect closes its socket as its task ends, not when it is told to)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import socket
import types

import pytest

from relayd.transports.loopback import Loopback
from tests.unit.test_peer_manager import Node, run

pytestmark = pytest.mark.timeout(60)


def test_close_ends_a_dial_still_connecting(tmp_path: pathlib.Path) -> None:
    token = tmp_path / "token"
    token.write_bytes(os.urandom(32).hex().encode())
    token.chmod(0o600)

    async def main() -> None:
        node = Node("a", Loopback(), token)
        # A listener whose one-place accept queue is full: a dial to it hangs.
        with socket.socket() as listener, socket.socket() as filler:
            listener.bind(("127.0.0.1", 0))
            listener.listen(0)
            filler.connect(listener.getsockname())
            port = listener.getsockname()[1]
            try:
                await node.peers.start()
                notifier = node.peers.notifier
                peer = types.SimpleNamespace(
                    address=f"127.0.0.1:{port}", notice_port=port, epoch="e", up=True
                )
                notifier.ensure_channel(peer)  # type: ignore[arg-type]
                [dial] = notifier._dialling.values()
                await asyncio.sleep(0)  # one turn: the connect is under way
                assert not dial.done()
                await notifier.close()
                assert dial.cancelled()
            finally:
                await node.close()
                node.dispose()

    run(main())
