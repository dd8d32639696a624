"""``relayd bench --gpu``: GPU -> GPU hand-off, relayd's two CUDA paths against a plain copy.

Methods, on one GPU, stop-and-wait, 256 KiB to 64 MiB:

* ``copy_`` - ``dst.copy_(src)`` and a device sync in one process: the floor.
* ``cuda_ipc_pool`` - a writer process puts into its lease of the daemon's GPU
  pool, a reader process copies out of it into its own tensor.
* ``cuda_ipc_direct`` - the writer puts storage handles, the reader opens them
  and copies (``get(copy=True)``).

Latency is one way: from the writer's ``put`` call to the moment the reader
holds its own tensor (both ``perf_counter_ns``, one clock per host). The pool
and direct runs use a daemon started here with ``--gpu-pool-size 512MiB``
(a small SHM arena, not page-locked: neither method touches it); the
transport is pinned on the writer's client, so the numbers do not depend on
how the two benchmark processes happen to be placed. Output: the same table
and JSON document as ``relayd bench``. Under the table, each relayd cell's
median is split as ``relayd bench`` splits it: the writer's put and the
DataRef's bytes, their trip to the reader, and the reader's parse and get
(each result's ``split_ns`` in the JSON), so a GPU run shows which side to
look at.

``--profile DIR``: after each size's measured transfers, :data:`PROFILED`
more run with :mod:`cProfile` on around the writer's ``put`` and around the
reader's ``get`` (never in the table's samples), and each side of each
method writes what they spent, by function, to ``DIR/<method>-put.txt`` and
``DIR/<method>-get.txt`` (4 files: a device check brings few back).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import json
import multiprocessing as mp
import pstats
import sys
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from relayd.launch import DaemonProcess, DaemonStartError
from relayd_bench._api import Parts
from relayd_bench._stats import (
    Result,
    Split,
    Status,
    add_ratios,
    machine_info,
    split_of,
    summarize,
    to_json,
)
from relayd_bench._table import render_table

SIZES = (256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
FLOOR = "copy_"
METHODS = (FLOOR, "cuda_ipc_pool", "cuda_ipc_direct")
# How long one side waits for the other before the method is marked failed.
ANSWER_TIMEOUT_S = 30.0
GPU_POOL = "512MiB"  # the largest payload four times over: never the bottleneck
DAEMON_READY_S, DAEMON_STOP_S = 60.0, 20.0
# Transfers per size run under the profiler with --profile, after the measured ones.
PROFILED = 30
# Functions each profile lists, by own time and by cumulative time.
PROFILE_ROWS = 30


def _iterations(quick: bool) -> tuple[int, int]:
    return (5, 30) if quick else (20, 200)


def _floor(size: int, warmup: int, iterations: int) -> list[int]:
    import torch

    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    samples: list[int] = []
    for i in range(warmup + iterations):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        dst.copy_(src)
        torch.cuda.synchronize()
        if i >= warmup:
            samples.append(time.perf_counter_ns() - t0)
    return samples


class SideProfile:
    """One side's :mod:`cProfile` of the calls it is told to profile, written as text."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._profile = cProfile.Profile() if path else None
        self.calls = 0

    @contextlib.contextmanager
    def around(self, on: bool) -> Iterator[None]:
        """Profile the ``with`` body when ``on`` (and a path was given)."""
        profile = self._profile if on else None
        if profile is None:
            yield
            return
        profile.enable()
        try:
            yield
        finally:
            profile.disable()
            self.calls += 1

    def write(self, title: str) -> None:
        if self._profile is None or self.path is None or not self.calls:
            return
        out = io.StringIO()
        out.write(f"{title}: {self.calls} calls profiled\n")
        stats = pstats.Stats(self._profile, stream=out)
        stats.sort_stats("tottime").print_stats(PROFILE_ROWS)
        stats.sort_stats("cumulative").print_stats(PROFILE_ROWS)
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        Path(self.path).write_text(out.getvalue(), encoding="utf-8")


def profile_path(directory: str | None, method: str, side: str) -> str | None:
    return str(Path(directory) / f"{method}-{side}.txt") if directory else None


def _reader(sock: str, conn: Connection, method: str, profile_dir: str | None) -> None:
    """The reader stage: get each DataRef it is sent, answer with the time it was done."""
    import torch
    from relayd_client import DataRef, RelayClient

    torch.cuda.set_device(0)
    torch.cuda.synchronize()  # initializes CUDA before attaching: the daemon learns the GPU
    profile = SideProfile(profile_path(profile_dir, method, "get"))

    async def serve() -> None:
        async with RelayClient("bench-reader", sock, timeout=30.0) as client:
            conn.send("ready")
            while True:
                sent = conn.recv()
                if sent is None:
                    return
                wire, profiled = sent
                started = time.perf_counter_ns()
                with profile.around(profiled):
                    await client.get(DataRef.from_bytes(wire))  # returns with the copy done
                conn.send((started, time.perf_counter_ns()))
                # Let the loop send the release notice before blocking in recv():
                # otherwise the lease stays held until the next get.
                await asyncio.sleep(0)

    asyncio.run(serve())
    profile.write(f"{method} get")


async def _writer(
    sock: str,
    conn: Connection,
    method: str,
    sizes: tuple[int, ...],
    warmup: int,
    n: int,
    profile_dir: str | None,
) -> dict[int, tuple[list[int], Split | None]]:
    """Per size: the one-way samples, and their split into the writer's side, the
    trip and the reader's side (see :func:`~relayd_bench._stats.split_of`)."""
    import torch
    from relayd_client import RelayClient
    from relayd_client.wire.transport import Transport

    out: dict[int, tuple[list[int], Split | None]] = {}
    profile = SideProfile(profile_path(profile_dir, method, "put"))
    extra = PROFILED if profile_dir else 0
    async with RelayClient("bench-writer", sock, timeout=30.0) as client:
        gpu = gpu_side(client)
        if gpu is None:
            raise RuntimeError("the client has no GPU paths (arena not mapped?)")
        gpu.force = Transport(method)
        for size in sizes:
            src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
            samples: list[int] = []
            parts: list[Parts] = []
            for i in range(warmup + n + extra):
                profiled = i >= warmup + n
                torch.cuda.synchronize()
                t0 = time.perf_counter_ns()
                with profile.around(profiled):
                    ref = await client.put(src, to_stage="bench-reader", request_id=f"g{size}-{i}")
                wire = ref.to_bytes()
                put_done = time.perf_counter_ns()  # the writer's side, as in relayd bench
                if ref.transport.value != method:
                    raise RuntimeError(f"{method} was asked for, {ref.transport.value} was taken")
                conn.send((wire, profiled))
                # Off the loop: the writer's session keeps taking Freed notices.
                answer = await asyncio.to_thread(_answer, conn)
                get_started, done = int(answer[0]), int(answer[1])
                if warmup <= i < warmup + n:
                    samples.append(done - t0)
                    parts.append((put_done - t0, get_started - put_done, done - get_started))
            out[size] = samples, split_of(parts)
    profile.write(f"{method} put")
    return out


def gpu_side(client: Any) -> Any:
    """The client's private GPU state (``None`` without GPU paths), to pin a transport.

    Private on purpose: pinning is for this benchmark, not for users. A unit
    test holds this path to the client's structure on machines without a GPU.
    """
    return client._conn.gpu


def _answer(conn: Connection) -> Any:
    """The reader's next message, or an error if it has gone quiet or away."""
    if not conn.poll(ANSWER_TIMEOUT_S):
        raise RuntimeError(f"the reader did not answer within {ANSWER_TIMEOUT_S:.0f} s")
    return conn.recv()


def _arena_bytes() -> int:
    """A small SHM arena (the GPU methods never use it) that fits this /dev/shm."""
    from relayd.preflight import SHM_MARGIN, shm_free_bytes

    try:
        free = shm_free_bytes()
    except OSError:
        return 64 << 20
    return max(8 << 20, min(64 << 20, (free - SHM_MARGIN - (4 << 20)) & ~((1 << 20) - 1)))


def _start_daemon(tmp: Path) -> DaemonProcess:
    daemon = DaemonProcess.serve(
        str(tmp / "relayd.sock"),
        settings={
            "shm_pool_size": _arena_bytes(),
            "gpu_pool_size": GPU_POOL,
            # Page-locking the arena would need RLIMIT_MEMLOCK and buys these methods nothing.
            "pin_host_memory": "off",
        },
        log_path=str(tmp / "relayd.log"),
    )
    try:
        return daemon.start(DAEMON_READY_S)
    except DaemonStartError as exc:
        print(f"relayd serve did not start: {exc}", file=sys.stderr)
        raise


def _relayd_methods(
    sizes: tuple[int, ...],
    warmup: int,
    n: int,
    results: list[Result],
    profile_dir: str | None = None,
) -> None:
    """Run the relayd methods into ``results``, each median split into its sides."""
    with tempfile.TemporaryDirectory(prefix="relayd-gpu-bench-") as tmp:
        try:
            daemon = _start_daemon(Path(tmp))
        except Exception as exc:
            for method in METHODS[1:]:
                for size in sizes:
                    results.append(
                        Result(method, size, Status.FAILED, reason=f"daemon: {exc}"[:200])
                    )
            return
        sock = daemon.socket
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        try:
            for method in METHODS[1:]:
                parent, child = ctx.Pipe()
                reader = ctx.Process(
                    target=_reader, args=(sock, child, method, profile_dir), daemon=True
                )
                reader.start()
                try:
                    if not parent.poll(60) or parent.recv() != "ready":
                        raise RuntimeError("the reader process did not attach")
                    by_size = asyncio.run(
                        _writer(sock, parent, method, sizes, warmup, n, profile_dir)
                    )
                    for size, (samples, split) in by_size.items():
                        results.append(_ok(method, size, warmup, samples, split))
                except Exception as exc:  # one method failing must not hide the others
                    for size in sizes:
                        results.append(Result(method, size, Status.FAILED, reason=f"{exc}"[:200]))
                finally:
                    with contextlib.suppress(OSError):
                        parent.send(None)
                    reader.join(10)
                    if reader.is_alive():
                        reader.kill()
        finally:
            daemon.stop(timeout_s=DAEMON_STOP_S)


def _ok(
    method: str, size: int, warmup: int, samples: list[int], split: Split | None = None
) -> Result:
    return Result(
        method, size, Status.OK, warmup=warmup, iterations=len(samples),
        latency=summarize(samples), split=split,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("relayd bench --gpu: no CUDA device visible; nothing measured", file=sys.stderr)
        return 2
    warmup, n = _iterations(bool(getattr(args, "quick", False)))
    results: list[Result] = []
    torch.cuda.set_device(0)
    for size in SIZES:
        results.append(_floor_result(size, warmup, n))
    _relayd_methods(SIZES, warmup, n, results, getattr(args, "profile", None))
    add_ratios(results, reference=FLOOR)
    machine = machine_info()
    machine["gpu"] = torch.cuda.get_device_name(0)
    machine["gpus"] = torch.cuda.device_count()
    print(render_table(results, machine=machine), end="")
    path = getattr(args, "json", None)
    if path:
        run_info = {"gpu": True, "warmup": warmup, "iterations": n, "reference": FLOOR}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(to_json(results, (), machine, run_info), f, indent=2)
    return 0 if all(r.status is Status.OK for r in results) else 1


def _floor_result(size: int, warmup: int, n: int) -> Result:
    return _ok(FLOOR, size, warmup, _floor(size, warmup, n))
