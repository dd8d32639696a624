"""What a reader checks before it touches memory, and what it remembers doing so.

A stage reads the same shapes and headers over and over; the verdict on a
layout is a pure function of (layout, region length) and a safe header's tree
of its bytes, so both are remembered, bounded. A read also leaves marks that
make a second read of the same DataRef in this process fail at once, without
depending on when the daemon clears the slot header: released lease ids, and
inline DataRefs read (they never reach the daemon).
"""

from __future__ import annotations

import threading
from typing import Any

from . import _codec_decode, _header_tree, _packing
from ._gpu_order import ReadOnce
from ._recent import Recent
from .wire.compact import RefFields, RefView
from .wire.errors import StaleRefError
from .wire.proto import relay_pb2 as pb

# Remembered per client, each; a full memory starts over.
_LAYOUT_MEMORY = 256
_HEADER_MEMORY = 256
_RELEASED_MEMORY = 4096
# A larger header is not worth keeping as part of a key.
SHAPE_HEADER_BYTES = 4096


def layout_specs(m: RefFields) -> list[_packing.TensorSpec]:
    """``m``'s layout entries as specs (unchecked)."""
    return [
        _packing.TensorSpec(
            index=t.index,
            shape=tuple(t.shape),
            dtype=t.dtype,
            offset=t.offset,
            nbytes=t.nbytes,
            device=t.device,
        )
        for t in m.tensors
    ]


class ReadChecks:
    """One client's remembered verdicts and read marks."""

    def __init__(self, lock: threading.RLock, allow_pickle: bool = False) -> None:
        self.lock = lock
        self.allow_pickle = allow_pickle
        self.valid_layouts: dict[tuple[tuple[bytes, ...], int], list[_packing.TensorSpec]] = {}
        self.headers: dict[bytes, Any] = {}
        self.header_bounds: dict[bytes, tuple[int, int]] = {}
        self.released: Recent[int] = Recent(_RELEASED_MEMORY)
        self.inline_reads = ReadOnce()  # (epoch, object id) of inline DataRefs read

    def checked_specs(self, m: RefFields, region_len: int) -> list[_packing.TensorSpec]:
        """The layout of ``m``, validated against a region of ``region_len`` bytes.

        Remembered by the raw layout entries, together with the specs built
        from them, which nobody mutates: building and hashing the specs on
        every get would be most of a get's checking time.
        """
        # Each entry's wire bytes: equal bytes, equal fields (one C call per
        # tensor instead of six attribute reads); a compact DataRef's shape
        # part made them once.
        if isinstance(m, RefView):
            key = (m.layout_key, region_len)
        else:
            key = (tuple([t.SerializeToString() for t in m.tensors]), region_len)
        specs = self.valid_layouts.get(key)
        if specs is None:
            specs = layout_specs(m)
            _packing.validate_layout(specs, region_len)
            if len(self.valid_layouts) >= _LAYOUT_MEMORY:
                self.valid_layouts.clear()
            self.valid_layouts[key] = specs
        return specs

    def decode_header(self, m: RefFields) -> Any:
        """The header's tree; a safe header seen before is not decoded again.

        Only trees that :func:`_flatten.rebuild` returns fresh are remembered
        (every list and dict in them holds a tensor or ref placeholder), so no
        two gets share a container the application might change.
        """
        header = m.header
        if m.header_codec == pb.HEADER_CODEC_PICKLE:
            return _codec_decode.decode_pickle(header, self.allow_pickle)
        tree = self.headers.get(header)
        if tree is None:
            tree = _codec_decode.decode(header)
            if len(header) <= SHAPE_HEADER_BYTES and _header_tree.refilled_fresh(tree):
                if len(self.headers) >= _HEADER_MEMORY:
                    self.headers.clear()
                self.headers[header] = tree
        return tree

    def slot_bounds(self, m: RefFields, tree: Any) -> tuple[int, int]:
        """:func:`_header_tree.slot_bounds` of ``tree``, remembered per safe header."""
        if m.header_codec == pb.HEADER_CODEC_PICKLE:
            return _header_tree.slot_bounds(tree)
        bounds = self.header_bounds.get(m.header)
        if bounds is None:
            bounds = _header_tree.slot_bounds(tree)
            if len(m.header) <= SHAPE_HEADER_BYTES:
                if len(self.header_bounds) >= _HEADER_MEMORY:
                    self.header_bounds.clear()
                self.header_bounds[m.header] = bounds
        return bounds

    def was_released(self, m: RefFields, epoch: str) -> bool:
        return m.lease.lease_id in self.released and m.origin.daemon_epoch == epoch

    def check_not_released(self, m: RefFields, epoch: str) -> None:
        # Until the daemon clears the header the bytes are still there: a second
        # read by this process must fail all the same, not depend on timing.
        if self.was_released(m, epoch):
            raise StaleRefError("this DataRef was already read and released by this client")

    def remember_released(self, lease_id: int) -> None:
        with self.lock:
            self.released.add(lease_id)

    def claim_inline(self, m: RefFields, what: str) -> tuple[str, str]:
        """Mark a DataRef with no lease read in this process; a second mark fails."""
        key = (m.origin.daemon_epoch, m.object_id)
        with self.lock:  # two threads of a blocking client may race for it
            self.inline_reads.claim(key, what)
        return key

    def forget_inline(self, key: tuple[str, str]) -> None:
        with self.lock:
            self.inline_reads.forget(key)
