"""A large arena logs its pre-faulting segment by segment (real /dev/shm)."""

from __future__ import annotations

import logging
import secrets

import pytest

from relayd.pools import arena as arena_mod

MiB = 1 << 20


def test_large_arena_logs_each_segment(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(arena_mod, "PROGRESS_FROM_BYTES", 4 * MiB)  # "large", cheaply
    caplog.set_level(logging.INFO, logger="relayd.pools.arena")
    a = arena_mod.Arena(
        node_id="progress",
        epoch=secrets.token_hex(4),
        total_bytes=4 * MiB,
        segment_bytes=MiB,
        slot_size=64 << 10,
    )
    try:
        lines = [r.getMessage() for r in caplog.records]
        assert lines[0] == "pre-faulting the SHM arena: 4 MiB in 4 segments of up to 1 MiB"
        assert [line.split(" (")[0] for line in lines[1:]] == [
            f"arena segment {i}/4 ready" for i in range(1, 5)
        ]
        assert lines[-1].startswith("arena segment 4/4 ready (4 of 4 MiB, ")
    finally:
        a.close()


def test_small_arena_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="relayd.pools.arena")
    a = arena_mod.Arena(
        node_id="progress",
        epoch=secrets.token_hex(4),
        total_bytes=4 * MiB,
        segment_bytes=MiB,
        slot_size=64 << 10,
    )
    a.close()
    assert caplog.records == []
