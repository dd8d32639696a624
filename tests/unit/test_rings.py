"""The Freed ring on its own: both ends in one process, a real sealed memfd."""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Iterator

import pytest
from relayd_client.wire.rings import RING_BYTES, RING_SLOTS, IdRing


@pytest.fixture
def ends() -> Iterator[tuple[IdRing, IdRing, int]]:
    daemon, fd = IdRing.create("relayd-freed")
    writer = IdRing.map(fd)
    yield daemon, writer, fd
    os.close(fd)
    daemon.close()
    writer.close()


def test_ids_arrive_once_in_order_across_the_wrap(ends: tuple[IdRing, IdRing, int]) -> None:
    daemon, writer, _ = ends
    sent: list[int] = []
    got: list[int] = []
    next_id = (7 << 32) | 1
    for burst in (1, 3, RING_SLOTS - 1, 5, RING_SLOTS, 2):
        for _ in range(burst):
            assert daemon.push(next_id)
            sent.append(next_id)
            next_id += 1
        assert daemon.unread() and writer.ready()
        got += writer.take()
        assert not daemon.unread() and not writer.ready() and writer.take() == []
    assert got == sent


def test_a_full_ring_refuses_until_the_writer_takes(ends: tuple[IdRing, IdRing, int]) -> None:
    daemon, writer, _ = ends
    assert all(daemon.push(i) for i in range(1, RING_SLOTS + 1))
    assert not daemon.push(RING_SLOTS + 1)  # this one goes by frame
    assert writer.take() == list(range(1, RING_SLOTS + 1))
    assert daemon.push(RING_SLOTS + 1) and writer.take() == [RING_SLOTS + 1]


def test_zero_is_never_written_it_means_empty(ends: tuple[IdRing, IdRing, int]) -> None:
    daemon, writer, _ = ends
    assert not daemon.push(0)
    assert not writer.ready()


def test_whatever_the_writer_scribbles_the_daemon_only_falls_back(
    ends: tuple[IdRing, IdRing, int],
) -> None:
    daemon, _, fd = ends
    scribble = mmap.mmap(fd, RING_BYTES)
    scribble[:] = os.urandom(RING_BYTES - 8) + b"\xff" * 8
    assert not daemon.push(5)  # its slot is not empty: the notice goes by frame
    assert daemon.unread()  # at worst a needless nudge
    scribble.close()


def test_the_ring_cannot_be_resized_under_the_daemons_mapping(
    ends: tuple[IdRing, IdRing, int],
) -> None:
    """A writer that shrank it would make the daemon's next push fault (SIGBUS)."""
    daemon, _, fd = ends
    for size in (0, RING_BYTES // 2, RING_BYTES * 2):
        with pytest.raises(PermissionError):
            os.ftruncate(fd, size)
    with pytest.raises(PermissionError):
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)  # no seal can be added
    assert daemon.push(1)


def test_the_writer_maps_only_a_sealed_ring_of_the_right_size() -> None:
    fd = os.memfd_create("not-a-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, RING_BYTES)
        with pytest.raises(ValueError, match="not sealed"):
            IdRing.map(fd)
        os.ftruncate(fd, RING_BYTES * 2)
        with pytest.raises(ValueError, match="wrong size"):
            IdRing.map(fd)
    finally:
        os.close(fd)
