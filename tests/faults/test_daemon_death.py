"""SIGKILL of the daemon under load: clear errors, no hang, re-attach, stale epochs refused."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from relayd_client import (
    DaemonUnavailableError,
    DataRef,
    RelayClient,
    RelayError,
    StaleEpochError,
)

from tests._figures import record
from tests._workers import digest, make_payload
from tests.faults._support import node_segments, start_daemon, unique_node

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
# A call made while the daemon is gone fails within its own deadline plus this.
SLACK = 1.5


async def _load(
    w: RelayClient, r: RelayClient, stop: asyncio.Event, out: list[str], trying: asyncio.Event
) -> None:
    """Puts and gets until the daemon dies; records how the in-flight call ended.

    ``trying`` is set as the first put starts: whoever waits on it resumes once
    that put has suspended, in flight.
    """
    i = 0
    while not stop.is_set():
        trying.set()
        try:
            ref = await w.put(
                make_payload(i, MiB), to_stage="talker", request_id=f"l{i}", timeout=2
            )
            await r.get(ref)
        except RelayError as exc:
            out.append(type(exc).__name__)
            return
        i += 1


def test_daemon_sigkill_gives_clear_errors_then_clients_reattach(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    import relayd_client._connection

    # Backoff far longer than any deadline below: only a call cutting it
    # short (it needs the daemon now) re-attaches in time.
    monkeypatch.setattr(relayd_client._connection, "RECONNECT_FIRST_DELAY", 60.0)
    monkeypatch.setattr(relayd_client._connection, "RECONNECT_MAX_DELAY", 60.0)
    node = unique_node()
    flags = ("--grant-size", "1MiB")
    d = start_daemon(str(tmp_path), node, *flags, pool="32MiB")
    figures: dict[str, object] = {}

    async def scenario() -> None:
        nonlocal d
        async with (
            RelayClient("thinker", d.socket, timeout=2) as w,
            RelayClient("talker", d.socket, timeout=2) as r,
        ):
            old_epoch = w.daemon_epoch
            unread = await w.put(make_payload(1, 2 * MiB), to_stage="talker", request_id="old")
            # Fill the stage's quota so one more put is waiting for space when the daemon dies.
            held = [
                await w.put(make_payload(i, 3 * MiB), to_stage="talker", request_id=f"f{i}")
                for i in range(4)
            ]
            waiting = asyncio.ensure_future(
                w.put(make_payload(5, 6 * MiB), to_stage="talker", request_id="w", timeout=30)
            )
            stop, trying, outcomes = asyncio.Event(), asyncio.Event(), []  # type: ignore[var-annotated]
            load = asyncio.ensure_future(_load(w, r, stop, outcomes, trying))
            await asyncio.wait_for(trying.wait(), 10)  # its put is in flight at the kill
            t0 = time.monotonic()
            os.kill(d.pid, signal.SIGKILL)
            # The waiting put was in flight: it fails fast, not at its 30 s deadline.
            with pytest.raises(DaemonUnavailableError):
                await asyncio.wait_for(waiting, 2 + SLACK)
            await asyncio.wait_for(load, 2 + SLACK)
            stop.set()
            figures["in_flight_failed_after_s"] = round(time.monotonic() - t0, 3)
            figures["load_outcome"] = outcomes
            assert all(o == "DaemonUnavailableError" for o in outcomes), outcomes
            # New calls while it is down: a clear error within their deadline, no hang.
            for call in (
                w.put(make_payload(2, MiB), to_stage="talker", request_id="n", timeout=1),
                r.get(held[0]),
                r.abort("old"),
            ):
                t = time.monotonic()
                with pytest.raises(DaemonUnavailableError):
                    await asyncio.wait_for(call, 2 + SLACK)
                assert time.monotonic() - t < 2 + SLACK
            # A SIGKILLed daemon leaves its segments (unless another daemon on this
            # host started meanwhile and removed them, which is as good).
            left = node_segments(node)

            d = start_daemon(str(tmp_path), node, *flags, pool="32MiB")  # same socket
            assert not set(left) & set(node_segments(node)), "old epoch's segments remain"
            # Clients re-attach on their own (the put waits for it within its deadline).
            t = time.monotonic()
            payload = make_payload(3, MiB)
            ref = await w.put(payload, to_stage="talker", request_id="new", timeout=10)
            figures["reattach_s"] = round(time.monotonic() - t, 3)
            assert w.daemon_epoch != old_epoch
            assert digest(await r.get(DataRef.from_bytes(ref.to_bytes()))) == digest(payload)
            with pytest.raises(StaleEpochError):
                await r.get(unread)
            with pytest.raises(StaleEpochError):
                await r.get(held[1])

    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
        assert d.status()["state"] == "DAEMON_STATE_SERVING"
        record("daemon-death", str(figures))
    finally:
        d.stop()
    assert node_segments(node) == []
