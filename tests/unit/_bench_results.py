"""Benchmark results as the bench's unit tests build them."""

from __future__ import annotations

from relayd_bench._stats import Cpu, Result, Split, Status, summarize


def ok(
    method: str,
    size: int,
    samples: list[int],
    cpu: Cpu | None = None,
    extra: dict[str, str] | None = None,
    split: Split | None = None,
) -> Result:
    """A measured cell: one warm-up, ``samples`` as the measured one-way times."""
    return Result(
        method,
        size,
        Status.OK,
        warmup=1,
        iterations=len(samples),
        latency=summarize(samples),
        cpu=cpu or Cpu(),
        extra=extra or {},
        split=split,
    )
