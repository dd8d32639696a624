"""A client notices a daemon that froze while a call of it waits on the session socket.

Keyed puts and takes, discards and cross-node fetches are answered on the
session socket, not by gRPC, so the gRPC channel's pings do not watch them
(``test_client_keepalive.py``). A stopped daemon (SIGSTOP, a stalled host)
keeps the socket open and answers nothing: a ``take_key`` waiting in it would
wait out its whole timeout. While a session call waits, the client probes a
daemon that has said nothing for ``KEEPALIVE_MS`` and fails the waiting
calls when the probe goes unanswered for ``KEEPALIVE_TIMEOUT_MS``; a live
daemon answers each probe at once, however long the call waits, and an idle
client probes nothing.

The client runs here, its keepalive shortened so that a test can wait for it;
the daemon is ``relayd serve`` in a child process, logging at debug level
each probe it answers (what shows that an idle client sent none).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator

import pytest
import relayd_client.wire.keepalive
from relayd_client import DaemonUnavailableError, RelayClient, RelayTimeoutError

from tests._daemon import Daemon, async_wait_until, frozen

pytestmark = pytest.mark.timeout(90)

KEEPALIVE_MS = 1000
KEEPALIVE_TIMEOUT_MS = 1000
# A probe after KEEPALIVE_MS of silence, then KEEPALIVE_TIMEOUT_MS for its
# answer; plus slack for a busy host.
NOTICED_WITHIN = (KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS) / 1000 + 3.0
# A take's own deadline when it meets a frozen daemon: far beyond NOTICED_WITHIN.
TAKE_TIMEOUT = 60.0
# A take that waits its whole timeout on a live daemon: long enough for
# several probes, each answered.
LIVE_TAKE = 4.5 * KEEPALIVE_MS / 1000
LIVE_PROBES = 3
# How long an idle client is watched for probes: several keepalive periods.
IDLE_FOR = 3 * KEEPALIVE_MS / 1000
CALL_BOUND = 10.0
# What the daemon logs (at debug level) for each probe it answers.
PROBE_LOG = "session probe answered"


@pytest.fixture
def daemon(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> Iterator[Daemon]:
    """A daemon logging each answered probe, the client's keepalive shortened."""
    monkeypatch.setattr(relayd_client.wire.keepalive, "KEEPALIVE_MS", KEEPALIVE_MS)
    monkeypatch.setattr(relayd_client.wire.keepalive, "KEEPALIVE_TIMEOUT_MS", KEEPALIVE_TIMEOUT_MS)
    d = Daemon(str(tmp_path), "--log-level", "debug", "--log-format", "json")
    d.start()
    try:
        yield d
    finally:
        if d.running():
            d.stop()


def probes_answered(d: Daemon, session_id: str) -> int:
    """The probes of ``session_id`` the daemon says it answered, from its log."""
    assert d.log_path is not None
    n = 0
    with open(d.log_path, errors="replace") as fh:
        for line in fh:
            if PROBE_LOG not in line:
                continue
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                n += record.get("msg") == PROBE_LOG and record.get("session_id") == session_id
    return n


def take(client: RelayClient, key: str, timeout: float) -> asyncio.Future[object]:
    """A take_key of ``key`` from stage "thinker", running."""
    return asyncio.ensure_future(client.take_key(key, from_stage="thinker", timeout=timeout))


async def waiting(client: RelayClient) -> None:
    """Until the client has a session call out, waiting for its answer."""
    await async_wait_until(
        lambda: client._conn.session._keyed, CALL_BOUND, "the take to wait for its answer"
    )


def test_a_take_waiting_on_a_frozen_daemon_fails_soon(daemon: Daemon) -> None:
    """DaemonUnavailableError long before the take's own deadline; the daemon,
    running again, answers the client's next calls."""

    async def scenario() -> None:
        async with RelayClient("talker", daemon.socket, timeout=CALL_BOUND) as r:
            pending = take(r, "k-frozen", TAKE_TIMEOUT)
            await waiting(r)
            with frozen(daemon):
                began = time.monotonic()
                try:
                    with pytest.raises(DaemonUnavailableError):
                        await asyncio.wait_for(pending, NOTICED_WITHIN)
                except TimeoutError:
                    raise AssertionError(
                        f"take_key still waited {NOTICED_WITHIN:.1f}s after the daemon froze "
                        f"(its own timeout: {TAKE_TIMEOUT:.0f}s)"
                    ) from None
                assert time.monotonic() - began < NOTICED_WITHIN
            # Running again, the daemon answers the client's next calls.
            status = await asyncio.wait_for(r.status(), CALL_BOUND)
            assert status.node_id == daemon.node_id
            assert (
                await asyncio.wait_for(
                    r.poll_key("k-frozen", from_stage="thinker", default="none"), CALL_BOUND
                )
                == "none"
            )

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_take_on_a_live_daemon_waits_its_whole_timeout(daemon: Daemon) -> None:
    """The daemon answers every probe: the take ends as it always did, at its own
    timeout with RelayTimeoutError, having been probed several times."""

    async def scenario() -> None:
        async with RelayClient("talker", daemon.socket, timeout=CALL_BOUND) as r:
            began = time.monotonic()
            with pytest.raises(RelayTimeoutError):
                await asyncio.wait_for(take(r, "k-live", LIVE_TAKE), LIVE_TAKE + CALL_BOUND)
            assert time.monotonic() - began >= LIVE_TAKE
            # The client watched the daemon all along, and the daemon answered.
            await async_wait_until(
                lambda: probes_answered(daemon, r._conn.session_id) >= LIVE_PROBES,
                CALL_BOUND,
                f"the daemon's log to show {LIVE_PROBES} probes answered during the take",
            )
            # The session is the one the take began on: no probe failed.
            assert r._conn.session is not None and not r._conn.lost

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_an_idle_client_sends_no_probe(daemon: Daemon) -> None:
    """No probe while no call waits, before a waiting call or after it: only
    during it, which shows that the daemon's log would tell."""

    async def scenario() -> None:
        async with RelayClient("talker", daemon.socket, timeout=CALL_BOUND) as r:
            session_id = r._conn.session_id
            await asyncio.sleep(IDLE_FOR)  # an idle spell, watched, not waited on
            assert probes_answered(daemon, session_id) == 0
            with pytest.raises(RelayTimeoutError):
                await take(r, "k-idle", 2.5 * KEEPALIVE_MS / 1000)
            await async_wait_until(
                lambda: probes_answered(daemon, session_id) >= 1,
                CALL_BOUND,
                "the daemon's log to show a probe answered during the take",
            )
            during = probes_answered(daemon, session_id)
            await asyncio.sleep(IDLE_FOR)  # idle again: no more probes
            assert probes_answered(daemon, session_id) == during

    asyncio.run(asyncio.wait_for(scenario(), 60))
