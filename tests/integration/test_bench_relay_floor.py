"""``floor-relay``: its two forwarder processes move every byte, and end with the run.

Both sides of the method run in this one process (the forwarders are processes
of their own, as in the bench): the writer's hooks copy and publish, the
reader's wait for the announcement and copy out.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from relayd_bench import _relay_floor
from relayd_bench._api import BenchContext
from relayd_bench._baselines import FLOOR_SLOTS
from relayd_bench._forwarder import OUT, WORD
from relayd_bench._relay_floor import FloorRelay

SHM = Path("/dev/shm")


@pytest.fixture
def ctx() -> Iterator[BenchContext]:
    prefix = f"relayd-test-relay-floor-{os.getpid()}-"  # not the bench smoke tests' prefix
    yield BenchContext(run_id="t", shm_prefix=prefix)
    assert not [p for p in SHM.iterdir() if p.name.startswith(prefix)]


def _pair(ctx: BenchContext, size: int) -> tuple[FloorRelay, FloorRelay, torch.Tensor]:
    source = torch.randint(0, 256, (size,), dtype=torch.uint8)
    writer, reader = FloorRelay(ctx), FloorRelay(ctx)
    blob = writer.setup_writer(size, source)
    reader.setup_reader(size, blob)
    writer.start_writer()
    # The two stand-ins, whose CPU the table counts as the daemons'.
    assert writer.daemon_pids() == (writer.fwd.proc.pid, reader.fwd.proc.pid)
    return writer, reader, source


def _close(writer: FloorRelay, reader: FloorRelay) -> None:
    writer.teardown_writer()
    reader.teardown_reader()
    # Closing their Unix sockets ended both forwarders, within the wait.
    assert writer.fwd.proc.returncode is not None and reader.fwd.proc.returncode is not None


@pytest.mark.parametrize("size", [5000, 256 << 10, _relay_floor.READ_MIN * 3 + 3])
def test_every_transfer_arrives_whole_in_its_slot(ctx: BenchContext, size: int) -> None:
    """Odd sizes, and one read in several wake-ups (past ``READ_MIN``); each slot
    used twice, each transfer's bytes stamped apart."""
    writer, reader, source = _pair(ctx, size)
    try:
        for i in range(2 * FLOOR_SLOTS):
            source[:8] = torch.tensor(list(i.to_bytes(8, "little")), dtype=torch.uint8)
            word = writer.send(i)
            got = reader.recv(memoryview(word))
            assert got.numel() == size
            assert zlib.crc32(got.numpy().tobytes()) == zlib.crc32(source.numpy().tobytes())
        reader.cleanup()
        assert reader.extra["rt"] == "0.50"  # the DataRef's trip only
    finally:
        _close(writer, reader)


def test_an_announcement_for_another_transfer_is_refused(ctx: BenchContext) -> None:
    writer, reader, _ = _pair(ctx, 4096)
    try:
        writer.send(0)
        with pytest.raises(ValueError, match="the DataRef says"):
            reader.recv(memoryview(WORD.pack(0, 1)))
    finally:
        _close(writer, reader)


def test_a_forwarder_that_dies_fails_the_read_and_nothing_hangs(ctx: BenchContext) -> None:
    writer, reader, _ = _pair(ctx, 4096)
    try:
        writer.fwd.proc.kill()
        writer.fwd.proc.wait()
        with pytest.raises(ConnectionError, match="went away"):
            reader.recv(memoryview(WORD.pack(0, 0)))
    finally:
        _close(writer, reader)


def test_a_forwarder_that_cannot_start_says_so(ctx: BenchContext) -> None:
    with pytest.raises(RuntimeError, match="said nothing"):
        _relay_floor._Forwarder(OUT, f"{ctx.shm_prefix}absent", 4096, "127.0.0.1")
