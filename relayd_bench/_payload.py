"""The payload every method moves, and the check that what arrived is that payload.

The source is ``size`` bytes of ``k mod 251`` (a prime, so the pattern never lines
up with page or cache-line sizes); before each transfer the harness writes the
transfer number into its first 8 bytes, outside the timed region. The reader's
check of those bytes and of the last byte catches stale slots and skipped copies.
Torch is imported inside the functions: the parent process never needs it.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

from relayd_bench._wire import BenchFailure

if TYPE_CHECKING:
    import torch

PATTERN_MOD = 251
MIN_SIZE = 64


def make_source(size: int) -> torch.Tensor:
    import torch

    # torch's CPU allocator aligns to 64 bytes, as the reference measurements' sources were
    return torch.arange(size, dtype=torch.int32).remainder_(PATTERN_MOD).to(torch.uint8)


class Stamp:
    """Writes the transfer number into the source's first 8 bytes (~0.3 µs, untimed)."""

    def __init__(self, source: torch.Tensor) -> None:
        self._source = source  # keeps the memory alive
        self._ptr = source.data_ptr()

    def __call__(self, i: int) -> None:
        ctypes.memmove(self._ptr, i.to_bytes(8, "little"), 8)


def check_tensor(t: Any, size: int, i: int) -> None:
    import torch

    if not isinstance(t, torch.Tensor):
        raise BenchFailure(f"transfer {i}: got {type(t).__name__}, not a tensor")
    if t.dtype != torch.uint8 or t.numel() != size or not t.is_contiguous():
        raise BenchFailure(
            f"transfer {i}: got {t.dtype} shape {tuple(t.shape)}, want contiguous uint8 [{size}]"
        )
    ptr = t.data_ptr()
    got = int.from_bytes(ctypes.string_at(ptr, 8), "little")
    if got != i:
        raise BenchFailure(f"transfer {i}: payload carries transfer number {got} (stale data?)")
    if ctypes.string_at(ptr + size - 1, 1)[0] != (size - 1) % PATTERN_MOD:
        raise BenchFailure(f"transfer {i}: last byte does not match the payload pattern")
