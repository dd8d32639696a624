"""Benchmark methods for the harness's own tests; spawned children import them by name.

Each moves the payload through a private bytes copy (no daemon, no /dev/shm), and
the lane named by ``BROKEN_LANE`` raises at transfer ``BREAKS_AT`` when the test
sets ``break_lane`` in its class.
"""

from __future__ import annotations

import asyncio
import time

import torch

from relayd_bench._api import AsyncPairMethod, PairMethod

BROKEN_LANE, BREAKS_AT = 1, 3
PAUSE_S = 0.002  # what a slow side sleeps per transfer: at least this much lands in its part


def _copy(method: PairMethod | AsyncPairMethod, source: torch.Tensor, i: int) -> bytes:
    if getattr(method, "break_lane", False) and method.ctx.lane == BROKEN_LANE and i == BREAKS_AT:
        raise RuntimeError(f"lane {BROKEN_LANE} broke at transfer {i}")
    return source.numpy().tobytes()


class Copy(PairMethod):
    def setup_writer(self, size: int, source: torch.Tensor) -> bytes:
        self.source = source
        return b""

    def send(self, i: int) -> bytes:
        return _copy(self, self.source, i)

    def recv(self, notify: memoryview) -> torch.Tensor:
        return torch.frombuffer(bytearray(notify), dtype=torch.uint8)


class AsyncCopy(AsyncPairMethod):
    async def setup_writer(self, size: int, source: torch.Tensor) -> bytes:
        self.source = source
        return b""

    async def send(self, i: int) -> bytes:
        return _copy(self, self.source, i)

    async def recv(self, notify: memoryview) -> torch.Tensor:
        return torch.frombuffer(bytearray(notify), dtype=torch.uint8)


class BrokenCopy(Copy):
    break_lane = True


class BrokenAsyncCopy(AsyncCopy):
    break_lane = True


class SlowSendCopy(Copy):
    def send(self, i: int) -> bytes:
        time.sleep(PAUSE_S)
        return super().send(i)


class SlowRecvAsyncCopy(AsyncCopy):
    async def recv(self, notify: memoryview) -> torch.Tensor:
        await asyncio.sleep(PAUSE_S)
        return await super().recv(notify)
