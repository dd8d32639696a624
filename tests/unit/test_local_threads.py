"""Process-local objects under threads: the blocking client's callers put and take
while another client's loop thread aborts a request or closes."""

from __future__ import annotations

import sys
import threading

from relayd_client import _local

KEPT = 50_000


class _Client:
    pass


def test_abort_and_unserve_while_other_threads_put_and_take() -> None:
    """Callers of blocking clients put and take local objects on their own
    threads; an abort or a close on another thread walks the same table, and
    must neither raise nor lose count of what it drops."""
    closing = _Client()
    _local.serve(("threads-closing",), closing)
    for i in range(KEPT):
        _local.put(object(), "threads-kept", "threads-kept", f"threads-kept-{i}")
    stop = threading.Event()
    churned: list[int] = []

    def churn() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            _local.put(object(), "threads-churn", "threads-churn", f"threads-churn-{n}")
            _local.take(f"threads-churn-{n}")
        churned.append(n)

    errors: list[BaseException] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # thread switches inside every walk of the table
    worker = threading.Thread(target=churn)
    worker.start()
    try:
        for i in range(20):
            try:
                assert _local.abort(f"threads-nothing-{i}") == 0
                _local.put(object(), "threads-closing", "threads-closing", f"threads-closing-{i}")
                _local.unserve(("threads-closing",), closing)
                _local.serve(("threads-closing",), closing)
            except RuntimeError as exc:
                errors.append(exc)
                break
    finally:
        stop.set()
        worker.join(30)
        sys.setswitchinterval(interval)
        _local.unserve(("threads-closing",), closing)
    assert not worker.is_alive() and churned and churned[0] > 0
    assert errors == []
    assert _local.abort("threads-kept") == KEPT
    assert not [k for k in _local._OBJECTS if k.startswith("threads-")]
