from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests._daemon import reap_workers


@pytest.fixture(autouse=True)
def _reap_spawned_workers() -> Iterator[None]:
    yield
    reap_workers()
