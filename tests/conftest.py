from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests._daemon import reap_workers
from tests._figures import COUNTS, FIGURES


@pytest.fixture(autouse=True)
def _reap_spawned_workers() -> Iterator[None]:
    yield
    reap_workers()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print what the fault and adversarial suites measured (see tests/_figures.py)."""
    if not FIGURES and not COUNTS:
        return
    terminalreporter.section("relayd fault and adversarial figures")
    for name, text in FIGURES:
        terminalreporter.write_line(f"{name}: {text}")
    for name, n in sorted(COUNTS.items()):
        terminalreporter.write_line(f"{name}: {n}")
