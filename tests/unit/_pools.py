"""What the lease-table unit tests share: a small, real arena of 64 KiB slots."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from relayd.pools.arena import Arena

SLOT = 64 << 10


@contextlib.contextmanager
def unit_arena(slots: int) -> Iterator[Arena]:
    """An arena of ``slots`` slots (and room for their headers), closed on exit."""
    a = Arena(
        node_id="unit",
        epoch=os.urandom(4).hex(),
        total_bytes=slots * SLOT + 8192,
        segment_bytes=1 << 30,
        slot_size=SLOT,
    )
    try:
        yield a
    finally:
        a.close()
