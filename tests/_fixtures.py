"""Fixtures more than one suite's conftest uses (each imports what it wants)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def separate_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writer and reader clients share the test process but must use the SHM path.

    Two stages in one process would exchange objects by reference
    (local_object); hide the process-local stage table so each client treats
    the other as a separate process, as the stages under test would be.
    """
    import relayd_client._local

    monkeypatch.setattr(relayd_client._local, "serves", lambda stage: False)
