"""RelayClient.status() / SyncRelayClient.status(): the daemon's status through the
client's own bound session (what vllm-omni's connector health() reports)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from relayd_client import RelayClient, SessionClosedError, SyncRelayClient
from relayd_client.wire.proto import relay_pb2 as pb

from tests._daemon import running_daemon

pytestmark = pytest.mark.timeout(120)


def test_status_through_the_clients_session(tmp_path: Path) -> None:
    with running_daemon(str(tmp_path)) as d:

        async def from_async() -> tuple[int, str, int]:
            async with RelayClient("a", d.socket) as c:
                st = await c.status()
                return st.state, st.node_id, len(st.pools)

        assert asyncio.run(from_async()) == (pb.DAEMON_STATE_SERVING, d.node_id, 1)
        with SyncRelayClient("b", d.socket) as c:
            st = c.status()
            assert (st.state, st.daemon_epoch) == (pb.DAEMON_STATE_SERVING, d.epoch)
            assert st.pools[0].capacity_bytes > 0
        with pytest.raises(SessionClosedError):
            c.status()
