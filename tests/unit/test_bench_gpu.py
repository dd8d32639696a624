"""``relayd bench --gpu`` without a GPU: its bookkeeping, timeouts and failure reporting."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from pathlib import Path

import pytest

from relayd_bench import gpu
from relayd_bench._stats import Split, Status, add_ratios, split_of, to_json
from relayd_bench._table import render_table
from tests._daemon import Daemon


def test_the_arena_fits_a_small_dev_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    import relayd.preflight as preflight

    for free, want in ((24 << 30, 64 << 20), (64 * 10**6, 41 << 20), (1 << 20, 8 << 20)):
        monkeypatch.setattr(preflight, "shm_free_bytes", lambda free=free: free)
        got = gpu._arena_bytes()
        assert got == want and got % (64 << 10) == 0  # whole slots


def test_a_silent_reader_fails_the_method_instead_of_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gpu, "ANSWER_TIMEOUT_S", 0.05)
    parent, child = mp.Pipe()
    with pytest.raises(RuntimeError, match="did not answer"):
        gpu._answer(parent)
    child.send(123)
    assert gpu._answer(parent) == 123


def test_a_daemon_that_does_not_start_fails_both_methods_with_a_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_daemon(tmp: object) -> None:
        raise RuntimeError("preflight: RLIMIT_MEMLOCK is 8 MiB")

    monkeypatch.setattr(gpu, "_start_daemon", no_daemon)
    results = [gpu._ok(gpu.FLOOR, size, 1, [1000 + size // 1000, 2000]) for size in gpu.SIZES]
    gpu._relayd_methods(gpu.SIZES, 1, 2, results, {})
    failed = [r for r in results if r.status is Status.FAILED]
    assert {r.method for r in failed} == set(gpu.METHODS[1:])
    assert len(failed) == 2 * len(gpu.SIZES) and all("RLIMIT_MEMLOCK" in r.reason for r in failed)
    add_ratios(results, reference=gpu.FLOOR)
    table = render_table(results, machine={"gpu": "none", "gpus": 0})
    assert "GB/s" in table and "cuda_ipc_pool" in table
    doc = to_json(results, (), {"gpu": "none"}, {"gpu": True})
    assert len(doc["results"]) == 3 * len(gpu.SIZES)


def test_the_benchmark_reaches_the_clients_gpu_state(tmp_path: Path) -> None:
    """The pool and direct methods pin the transport through the client's private
    GPU state: the path to it is checked here, where no GPU can run them."""
    from relayd_client import RelayClient

    assert gpu.gpu_side(RelayClient("bench-writer", str(tmp_path / "none.sock"))) is None
    d = Daemon(str(tmp_path)).start()
    try:

        async def attached() -> None:
            async with RelayClient("bench-writer", d.socket, timeout=10.0) as client:
                side = gpu.gpu_side(client)  # built where the arena is mapped, GPU or not
                assert side is not None and side.force is None

        asyncio.run(attached())
    finally:
        assert d.stop() == 0


def test_a_gpu_cell_carries_its_split_into_the_table_and_the_json() -> None:
    ns = 1000
    parts = [
        (300 * ns, 88 * ns, 545 * ns),
        (310 * ns, 88 * ns, 9000 * ns),
        (290 * ns, 88 * ns, 500 * ns),
    ]
    cell = gpu._ok("cuda_ipc_pool", 4 << 20, 2, [sum(p) for p in parts], split_of(parts))
    assert cell.split == Split(300_000.0, 88_000.0, 545_000.0)
    rows = [line.split() for line in render_table([cell]).splitlines()]
    assert ["cuda_ipc_pool", "300/88/545"] in rows
    assert to_json([cell], (), {}, {})["results"][0]["split_ns"]["trip_ns"] == 88_000.0


def test_a_side_profile_lists_the_profiled_calls_only(tmp_path: Path) -> None:
    def measured_put() -> int:
        return sum(range(1000))

    def warmup_put() -> int:
        return sum(range(10))

    path = gpu.profile_path(str(tmp_path / "prof"), "cuda_ipc_pool", "put")
    assert path == str(tmp_path / "prof" / "cuda_ipc_pool-put.txt")
    side = gpu.SideProfile(path)
    with side.around(False):
        warmup_put()
    for _ in range(3):
        with side.around(True):
            measured_put()
    side.write("cuda_ipc_pool put")
    text = (tmp_path / "prof" / "cuda_ipc_pool-put.txt").read_text()
    assert text.startswith("cuda_ipc_pool put: 3 calls profiled")
    assert "measured_put" in text and "warmup_put" not in text

    # Without --profile nothing is profiled and nothing written.
    assert gpu.profile_path(None, "cuda_ipc_pool", "get") is None
    off = gpu.SideProfile(None)
    with off.around(True):
        measured_put()
    off.write("cuda_ipc_pool get")
    assert off.calls == 0 and sorted(p.name for p in (tmp_path / "prof").iterdir()) == [
        "cuda_ipc_pool-put.txt"
    ]


def test_the_cli_takes_a_profile_directory_for_the_gpu_benchmark() -> None:
    from relayd_bench import _cli

    args = _cli.build_parser().parse_args(["--gpu", "--quick", "--profile", "out/prof"])
    assert args.gpu and args.profile == "out/prof"
