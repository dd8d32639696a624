"""Blocking clients of one process, each on its own loop thread, telling each other of aborts."""

from __future__ import annotations

import threading

import pytest
from relayd_client import AbortedError, RelayError, SyncRelayClient

from tests._daemon import running_daemon, wait_until

pytestmark = pytest.mark.timeout(120)


def test_an_abort_by_another_blocking_client_of_the_process_wakes_a_waiting_reader(
    tmp_path: object,
) -> None:
    """The daemon tells only the aborting stage of an abort ahead of any lease;
    the aborting client tells this process's other clients itself. Each of
    those runs its own loop: the reader's is woken from its own thread, which
    asyncio's debug mode (``python -X dev``) checks."""
    with (
        running_daemon(str(tmp_path)) as d,
        SyncRelayClient("thinker", d.socket) as w,
        SyncRelayClient("talker", d.socket) as r,
    ):
        for client in (w, r):
            assert client._loop is not None
            client._loop.loop.set_debug(True)
        outcome: list[type[BaseException] | None] = []

        def read() -> None:
            try:
                list(r.stream("doomed", from_stage="thinker", timeout=60))
            except RelayError as exc:
                outcome.append(type(exc))
            else:
                outcome.append(None)

        reader = threading.Thread(target=read)
        reader.start()
        try:
            wait_until(lambda: r._client._streams.has("doomed"), 10, "the reader waiting")
            assert w.abort("doomed") == 0
            reader.join(10)
            assert not reader.is_alive()
            assert outcome == [AbortedError]
        finally:
            r.close()  # ends a reader still waiting
            reader.join(30)
