"""A client's gRPC channel notices a daemon that froze while a call of it waits.

A stopped daemon (SIGSTOP, a stalled host) keeps its sockets open: nothing
ends, and a call waiting in it (a put's Grant call waiting for space) would
wait out its whole timeout. The channel pings the daemon once it is silent and
fails the call when a ping goes unanswered; a live daemon answers those pings,
and permits them at that pace, however long the call waits.

The client runs here, its keepalive shortened so that a test can wait for it;
the daemon is ``relayd serve`` in a child process whose ping policy is
shortened to match (:data:`relayd.server.GRPC_CLIENT_PING_MIN_MS`, half the
client's pace, as in production).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator

import pytest
import relayd_client._connection
from relayd_client import DaemonUnavailableError, RelayClient, ResourceExhaustedError

from tests._daemon import Daemon, async_wait_until, frozen
from tests._workers import make_payload

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
# gRPC pings at most once a second, whatever the keepalive time.
KEEPALIVE_MS = 1000
# Generous: a loaded host may answer a live daemon's ping or probe late.
KEEPALIVE_TIMEOUT_MS = 3000
# A ping after KEEPALIVE_MS of silence (a timer that may have just been reset),
# then KEEPALIVE_TIMEOUT_MS for its answer; plus slack for a busy host.
NOTICED_WITHIN = (2 * KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS) / 1000 + 3.0
# Pings a waiting call sends a live daemon first: more than gRPC's default of two
# without data between them, and more than a server with gRPC's default ping
# policy takes (it ended the connection, too_many_pings, at the fifth).
LIVE_PINGS = 6
# The waiting put's own deadline: far beyond NOTICED_WITHIN.
PUT_TIMEOUT = 60.0
CALL_BOUND = 10.0

# `relayd serve`, its ping policy as shortened as the client's keepalive.
_SERVE = """
import sys
from relayd import cli, server

server.GRPC_CLIENT_PING_MIN_MS = int(sys.argv[1])
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.fixture
def daemon(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> Iterator[Daemon]:
    """A daemon with a 16 MiB arena (an 8 MiB stage quota) in 1 MiB grants, the
    client's keepalive and the daemon's ping policy shortened."""
    monkeypatch.setattr(relayd_client._connection, "KEEPALIVE_MS", KEEPALIVE_MS)
    monkeypatch.setattr(relayd_client._connection, "KEEPALIVE_TIMEOUT_MS", KEEPALIVE_TIMEOUT_MS)
    # The test leaves its puts unread: a drain need not wait for them.
    d = Daemon(str(tmp_path), "--grant-size", "1MiB", "--drain-grace", "0", pool="16MiB")
    assert d.args[:4] == [sys.executable, "-m", "relayd", "serve"], d.args
    d.args = [sys.executable, "-c", _SERVE, str(KEEPALIVE_MS // 2), *d.args[3:]]
    d.start()
    try:
        yield d
    finally:
        if d.running():
            d.stop()


async def fill(w: RelayClient) -> None:
    """Puts nobody reads, until the writer's stage quota is spent."""
    with pytest.raises(ResourceExhaustedError):
        for i in range(20):
            await w.put(
                make_payload(i, 3 * MiB), to_stage="talker", request_id=f"r{i}", timeout=0.5
            )


def test_a_put_waiting_for_space_fails_soon_after_the_daemon_freezes(daemon: Daemon) -> None:
    """The put waits through the channel's pings while the daemon answers them,
    then fails once the daemon stops answering: DaemonUnavailableError, long
    before its own deadline. The session socket cannot tell: it stays open."""

    async def scenario() -> None:
        async with RelayClient("thinker", daemon.socket, timeout=CALL_BOUND) as w:
            await fill(w)
            put = asyncio.ensure_future(
                w.put(
                    make_payload(99, 3 * MiB),
                    to_stage="talker",
                    request_id="late",
                    timeout=PUT_TIMEOUT,
                )
            )
            await async_wait_until(w._conn.grants.waiting, CALL_BOUND, "the put's Grant call")
            # The keepalive's own pace: a live daemon answers and permits the
            # pings, and the put goes on waiting.
            await asyncio.sleep(LIVE_PINGS * KEEPALIVE_MS / 1000)
            assert not put.done(), put
            with frozen(daemon):
                began = time.monotonic()
                try:
                    with pytest.raises(DaemonUnavailableError):
                        await asyncio.wait_for(put, NOTICED_WITHIN)
                except TimeoutError:
                    raise AssertionError(
                        f"the put still waited {NOTICED_WITHIN:.1f}s after the daemon froze"
                    ) from None
                assert time.monotonic() - began < NOTICED_WITHIN
            # Running again, the daemon answers the client's next call.
            status = await asyncio.wait_for(w.status(), CALL_BOUND)
            assert status.node_id == daemon.node_id

    asyncio.run(asyncio.wait_for(scenario(), 50))
