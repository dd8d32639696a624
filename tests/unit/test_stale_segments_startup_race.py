"""Removing a dead daemon's segments while another daemon is creating its arena."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest
from relayd_client.wire.paths import SHM_DIR

from relayd.pools import arena as arena_mod
from relayd.pools.arena import Arena, remove_stale_segments


@pytest.fixture
def node() -> Iterator[str]:
    name = f"race{secrets.token_hex(4)}"
    yield name
    for left in os.listdir(SHM_DIR):
        if left.startswith(f"relayd.{name}."):
            os.unlink(os.path.join(SHM_DIR, left))


def test_a_starting_daemons_lock_is_not_taken_for_a_dead_ones(
    node: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another daemon starting on the node sweeps /dev/shm between this one creating
    its arena lock file and locking it: the arena must stay intact and locked, so no
    later sweep takes its live segments for a dead daemon's."""
    real_flock = arena_mod.fcntl.flock
    swept: list[str] = []
    sweeping: list[bool] = []

    def sweep_then_flock(fd: int, op: int) -> None:
        if not sweeping:  # once, and not within the sweep's own flock
            sweeping.append(True)
            swept.extend(remove_stale_segments())
        real_flock(fd, op)

    monkeypatch.setattr(arena_mod.fcntl, "flock", sweep_then_flock)
    arena = Arena(
        node_id=node, epoch="e1", total_bytes=4 << 20, segment_bytes=2 << 20, slot_size=1 << 20
    )
    monkeypatch.setattr(arena_mod.fcntl, "flock", real_flock)
    try:
        ours = sorted(n for n in os.listdir(SHM_DIR) if n.startswith(arena.prefix + "."))
        assert ours == [f"{arena.prefix}.0", f"{arena.prefix}.1", f"{arena.prefix}.lock"]
        # The sweep took the first lock file for a dead daemon's: the arena made another.
        assert [n for n in swept if n.startswith(arena.prefix + ".")] == [f"{arena.prefix}.lock"]
        # The next daemon to start sweeps again: the live arena is not stale.
        assert not [n for n in remove_stale_segments() if n.startswith(arena.prefix + ".")]
        assert sorted(n for n in os.listdir(SHM_DIR) if n.startswith(arena.prefix + ".")) == ours
    finally:
        arena.close()
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(arena.prefix + ".")]
