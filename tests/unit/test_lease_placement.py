"""Where a DataRef's lease may lie in a segment: ``MappedSegment.misplaced``, the one
bounds check that both the general read path and the read lanes ask."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from relayd_client.wire.shm import MappedSegment, segment_nslots

SLOT = 4096
SEGMENT_BYTES = 16 * (SLOT + 64) + 8192
N = segment_nslots(SEGMENT_BYTES, SLOT)


@pytest.fixture(scope="module")
def seg() -> Iterator[MappedSegment]:
    name = f"relayd-test-placement-{os.getpid()}-{os.urandom(4).hex()}"
    s = MappedSegment(name, SEGMENT_BYTES, 0, SLOT, create=True)
    try:
        yield s
    finally:
        s.close()
        os.unlink(f"/dev/shm/{name}")


OUTSIDE, OFF_SLOT = "lies outside the arena", "offset does not match its slot"

# name: (slot, nslots, offset past the slot's own, length, what is wrong)
CASES: dict[str, tuple[int, int, int, int, str | None]] = {
    "one slot, full": (0, 1, 0, SLOT, None),
    "the last slots exactly": (N - 2, 2, 0, 2 * SLOT, None),
    "empty": (3, 1, 0, 0, None),
    "one slot past the end": (N - 1, 2, 0, SLOT, OUTSIDE),
    "starting past the end": (N, 1, 0, 1, OUTSIDE),
    "no slot at all": (0, 0, 0, 0, OUTSIDE),
    "a byte longer than its slots": (2, 2, 0, 2 * SLOT + 1, OUTSIDE),
    "a huge slot count": (1, 1 << 40, 0, 1, OUTSIDE),
    "data a byte into its slot": (5, 1, 1, 16, OFF_SLOT),
    "data at the next slot's": (5, 1, SLOT, 16, OFF_SLOT),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_lease_lies_in_its_slots_or_is_told_what_is_wrong(seg: MappedSegment, case: str) -> None:
    slot, nslots, skew, length, wrong = CASES[case]
    assert seg.nslots == N >= 8  # room for the cases' leases
    assert seg.misplaced(slot, nslots, seg.data_offset + slot * SLOT + skew, length) == wrong
