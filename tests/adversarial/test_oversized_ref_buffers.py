"""An oversized DataRef handed over as a buffer is refused before it is copied.

``DataRef.from_bytes`` takes bytes, a bytearray or a memoryview (an
application that receives into one buffer passes a view of it). Whatever
the size, a reader must not copy more than a DataRef can be just to find
out that it is too large.
"""

from __future__ import annotations

import mmap
import tracemalloc

import pytest
from relayd_client import CorruptRefError, DataRef
from relayd_client.wire.dataref import MAX_REF_BYTES

_HUGE = 4 * MAX_REF_BYTES


def _peak_while_refused(data: object) -> int:
    tracemalloc.start()
    try:
        with pytest.raises(CorruptRefError, match=f"exceeds {MAX_REF_BYTES}"):
            DataRef.from_bytes(data)  # type: ignore[arg-type]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


def test_an_oversized_bytearray_is_refused_without_a_copy() -> None:
    assert _peak_while_refused(bytearray(_HUGE)) < 1 << 20


def test_an_oversized_memoryview_is_refused_without_a_copy() -> None:
    with mmap.mmap(-1, _HUGE) as mm:
        view = memoryview(mm)
        try:
            assert _peak_while_refused(view) < 1 << 20
            # A view of wider items counts bytes, not items.
            wide = view.cast("Q")
            try:
                assert len(wide) == _HUGE // 8 < MAX_REF_BYTES
                assert _peak_while_refused(wide) < 1 << 20
            finally:
                wide.release()
        finally:
            view.release()
