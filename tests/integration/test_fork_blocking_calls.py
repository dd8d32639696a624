"""In a forked child, every call of the parent's blocking client is refused at once.

The child has no copy of the client's loop thread: a call handed to that loop
would wait, unanswered, until its deadline and then report a timeout.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
from relayd_client import SessionClosedError, SyncRelayClient

from tests._daemon import Daemon, kill9, reap, running_daemon, wait_until

pytestmark = pytest.mark.timeout(180)

# Each call that the blocking client runs on its loop thread.
CALLS: dict[str, Callable[[SyncRelayClient], Any]] = {
    "status": lambda c: c.status(),
    "abort": lambda c: c.abort("r"),
    "take_key": lambda c: c.take_key("k", from_stage="talker", timeout=1),
    "stream": lambda c: next(iter(c.stream("r", from_stage="talker", timeout=1))),
}


def _in_child(call: Callable[[], Any]) -> int:
    """Run ``call`` in a forked child: 0 if it raised the fork refusal, else 1."""
    pid = os.fork()
    if pid == 0:  # never return into pytest
        code = 1
        try:
            try:
                call()
            except SessionClosedError as exc:
                code = 0 if "fork" in str(exc) else 1
            except BaseException as exc:
                os.write(2, f"the child's call raised {exc!r}\n".encode())
        finally:
            os._exit(code)
    return reap(pid, 60, "the forked child to finish")


@pytest.mark.parametrize("name", list(CALLS))
def test_a_forked_child_is_refused_each_loop_call(tmp_path: object, name: str) -> None:
    with running_daemon(str(tmp_path)) as d, SyncRelayClient("thinker", d.socket, timeout=2) as c:
        assert _in_child(lambda: CALLS[name](c)) == 0
        c.status()  # the parent's client goes on


def test_a_forked_child_of_a_reattaching_client_is_refused_a_get(tmp_path: object) -> None:
    """While the parent's client waits for its daemon to come back, a get in
    the child takes the re-attach path: refused there too."""
    d = Daemon(str(tmp_path)).start()
    try:
        with (
            SyncRelayClient("thinker", d.socket, timeout=2) as w,
            SyncRelayClient("talker", d.socket, timeout=2) as r,
        ):
            ref = w.put({"x": 1}, to_stage="talker", request_id="r")
            kill9(d.proc)  # type: ignore[arg-type]
            wait_until(lambda: r._client._conn.lost, 30, "the client to see the daemon go")
            assert _in_child(lambda: r.get(ref)) == 0
            d = Daemon(str(tmp_path)).start()
            r.status()  # the parent's client re-attaches
            assert r.daemon_epoch == d.epoch
    finally:
        d.stop()
