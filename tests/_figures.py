"""Figures the fault and adversarial suites report in the run's summary.

Tests call :func:`record`; ``tests/conftest.py`` prints everything recorded at
the end of the session, so CI logs carry the numbers without ``-s``.
"""

from __future__ import annotations

import collections

FIGURES: list[tuple[str, str]] = []
COUNTS: collections.Counter[str] = collections.Counter()


def record(name: str, text: str) -> None:
    FIGURES.append((name, text))
    print(f"\n{name}: {text}")


def count(name: str, n: int = 1) -> None:
    """Accumulate a tally (e.g. bad inputs tried) reported once at the end."""
    COUNTS[name] += n
