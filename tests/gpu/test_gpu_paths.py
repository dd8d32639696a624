"""GPU paths end to end: the real daemon with GPU pools, real stage processes.

Skipped (and counted as skipped) without a CUDA device. Routes come from the
daemon: a writer that attaches before touching CUDA is a "placement without
GPU", so same-GPU traffic goes through the pool; one that initializes CUDA
first shares the reader's GPU and gets cuda_ipc_direct.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from tests._daemon import _SPAWNED, Daemon, running_daemon, wait_until  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KiB, MiB = 1 << 10, 1 << 20


class Stage:
    """One stage process speaking JSON lines."""

    def __init__(self, socket: str, stage: str, *, cuda_first: bool, device: int = 0) -> None:
        args = [sys.executable, "-m", "tests.gpu._gpu_worker", "--socket", socket, "--stage", stage]
        if cuda_first:
            args += ["--cuda-first", "--device", str(device)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT)
        _SPAWNED.append(self.proc)
        assert self.call_raw() == {"ready": True}

    def call_raw(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"stage process exited with {self.proc.wait(10)}")
        return dict(json.loads(line))

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        answer = self.call_raw()
        assert "error" not in answer, answer["error"]
        return answer

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def _memlock_allows_pinning(need: int = 256 * MiB) -> bool:
    """Raise RLIMIT_MEMLOCK to its hard limit (inherited by the daemon and stages);
    True when that covers the arena, as preflight requires for pinning."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and soft < need:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
            soft = hard
    return bool(soft == resource.RLIM_INFINITY or soft >= need)


PIN = _memlock_allows_pinning()


@pytest.fixture
def daemon(tmp_path: Any) -> Iterator[Daemon]:
    pin = [] if PIN else ["--pin-host-memory", "off"]
    with running_daemon(
        str(tmp_path), "--gpu-pool-size", "256MiB", "--lease-ttl", "3", *pin, pool="256MiB"
    ) as d:
        yield d


def _gpu_pools(d: Daemon) -> list[dict[str, Any]]:
    return [p for p in d.status()["pools"] if str(p["name"]).startswith("cuda:")]


def _round_trip(
    w: Stage, r: Stage, nbytes: int, seed: int, where: str = "cuda", heavy: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    put = w.call(op="put", to="talker", rid=f"r{seed}", seed=seed, nbytes=nbytes, where=where,
                 heavy=heavy)  # fmt: skip
    got = r.call(op="get", ref=put["ref"])
    assert got["digest"] == put["digest"], f"bytes differ at {nbytes} B ({put['transport']})"
    return put, got


def test_daemon_exports_one_pool_per_gpu(daemon: Daemon) -> None:
    pools = _gpu_pools(daemon)
    assert len(pools) == torch.cuda.device_count()
    for p in pools:
        assert int(p["capacity_bytes"]) == 256 * MiB and int(p["used_bytes"]) == 0
        assert int(p["largest_free_run_bytes"]) == 256 * MiB


def test_pool_round_trip_same_gpu_and_one_import_per_process(daemon: Daemon) -> None:
    w = Stage(daemon.socket, "thinker", cuda_first=False)
    r = Stage(daemon.socket, "talker", cuda_first=True)
    for i, n in enumerate((256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 300 * KiB + 7)):
        put, got = _round_trip(w, r, n, seed=i)
        assert put["transport"] == "cuda_ipc_pool" and got["devices"] == ["cuda", "cuda"]
    assert w.call(op="facts")["pool_imports"] == 1
    assert r.call(op="facts")["pool_imports"] == 1
    wait_until(lambda: int(_gpu_pools(daemon)[0]["used_bytes"]) == 0, 10, "GPU pool to drain")


def test_direct_round_trip(daemon: Daemon) -> None:
    w = Stage(daemon.socket, "thinker", cuda_first=True)
    r = Stage(daemon.socket, "talker", cuda_first=True)
    for i, n in enumerate((256 * KiB, 8 * MiB)):
        put, got = _round_trip(w, r, n, seed=100 + i)
        assert put["transport"] == "cuda_ipc_direct" and got["devices"] == ["cuda", "cuda"]
    assert int(_gpu_pools(daemon)[0]["used_bytes"]) == 0  # no pool, no lease


def test_gpu_to_cpu_reader_gets_cpu_tensors(daemon: Daemon) -> None:
    w = Stage(daemon.socket, "thinker", cuda_first=True)
    r = Stage(daemon.socket, "talker", cuda_first=False)
    put, got = _round_trip(w, r, 4 * MiB, seed=200)
    assert put["transport"] == "shm" and got["devices"] == ["cpu", "cpu"]
    assert r.call(op="facts")["cuda"] is False  # a CPU stage never creates a CUDA context


def test_cpu_to_gpu_and_mixed_payloads(daemon: Daemon) -> None:
    w = Stage(daemon.socket, "thinker", cuda_first=True)
    r = Stage(daemon.socket, "talker", cuda_first=True)
    put, got = _round_trip(w, r, 4 * MiB, seed=300, where="cpu")
    assert got["devices"] == ["cpu", "cpu"]  # CPU leaves stay on CPU
    put, got = _round_trip(w, r, 4 * MiB, seed=301, where="mixed")
    # sorted keys: cpu, extra, hidden -> CPU leaf on CPU, CUDA leaves on the GPU
    assert put["transport"] == "shm" and got["devices"] == ["cpu", "cuda", "cuda"]
    assert r.call(op="facts")["pinned"] is PIN  # arena page-locked: H2D is DMA


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_pool_round_trip_across_gpus(daemon: Daemon) -> None:
    w = Stage(daemon.socket, "thinker", cuda_first=True, device=0)
    r = Stage(daemon.socket, "talker", cuda_first=True, device=1)
    for i, n in enumerate((256 * KiB, 16 * MiB)):
        put, got = _round_trip(w, r, n, seed=400 + i)
        assert put["transport"] in ("cuda_ipc_pool", "shm")  # shm where no peer access
        assert got["devices"] == ["cuda", "cuda"]


def test_reader_never_sees_a_half_written_lease(daemon: Daemon) -> None:
    w = Stage(daemon.socket, "thinker", cuda_first=False)
    r = Stage(daemon.socket, "talker", cuda_first=True)
    for i in range(6):
        # The source is a matmul chain still running when put() enqueues its copy.
        put, _ = _round_trip(w, r, 32 * MiB, seed=500 + i, heavy=True)
        assert put["transport"] == "cuda_ipc_pool"


def test_kill_9_writer_and_reader_returns_the_pool_to_zero(daemon: Daemon) -> None:
    w = Stage(daemon.socket, "thinker", cuda_first=False)
    refs = [
        w.call(op="put", to="talker", rid=f"k{i}", seed=600 + i, nbytes=8 * MiB)["ref"]
        for i in range(6)
    ]
    wait_until(
        lambda: int(_gpu_pools(daemon)[0]["used_bytes"]) >= 6 * 8 * MiB, 10, "six published leases"
    )
    w.kill()
    r = Stage(daemon.socket, "talker", cuda_first=True)
    for ref in refs[:3]:
        r.send(op="get", ref=ref)  # in flight when it dies: some claimed, some not
    r.kill()
    wait_until(
        lambda: (
            int(_gpu_pools(daemon)[0]["used_bytes"]) == 0
            and not [
                x
                for x in daemon.status().get("leases", [])
                if str(x.get("pool", "")).startswith("cuda:")
            ]
        ),
        15,
        "the GPU pool to be reclaimed after kill -9 (TTL 3 s)",
    )
