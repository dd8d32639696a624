from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests._daemon import reap_workers
from tests._figures import COUNTS, FIGURES


@pytest.fixture(autouse=True)
def _reap_spawned_workers() -> Iterator[None]:
    yield
    reap_workers()


# Under pytest-xdist each worker records its own figures: a worker hands them to
# the controller as it finishes, which prints them all.
_WORKER_KEY = "relayd_figures"


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out[_WORKER_KEY] = json.dumps({"figures": FIGURES, "counts": dict(COUNTS)})


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    data = getattr(node, "workeroutput", {}).get(_WORKER_KEY)
    if data:
        got = json.loads(data)
        FIGURES.extend((name, text) for name, text in got["figures"])
        COUNTS.update(got["counts"])


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print what the fault and adversarial suites measured (see tests/_figures.py)."""
    if not FIGURES and not COUNTS:
        return
    terminalreporter.section("relayd fault and adversarial figures")
    for name, text in FIGURES:
        terminalreporter.write_line(f"{name}: {text}")
    for name, n in sorted(COUNTS.items()):
        terminalreporter.write_line(f"{name}: {n}")
