"""GPU paths end to end: the real daemon with GPU pools, real stage processes.

Skipped (and counted as skipped) without a CUDA device. Routes come from the
daemon: a writer that attaches before touching CUDA is a "placement without
GPU", so same-GPU traffic goes through the pool; one that initializes CUDA
first shares the reader's GPU and gets cuda_ipc_direct. A reader must be
attached before the put, or the daemon routes through shm (reader unknown).

One daemon serves the whole module (a daemon with a GPU pool takes seconds
to start, and tests/gpu/run_device_checks.sh has five minutes for tests and
benchmark); every test starts only when the previous one's sessions are gone
and the GPU pools are empty again, and names its stages uniquely.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from tests._daemon import _DAEMONS, _SPAWNED, Daemon, wait_until  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KiB, MiB = 1 << 10, 1 << 20
GPU_POOL = 256 * MiB
CALL_TIMEOUT = 60.0  # one command of a stage process
READY_TIMEOUT = 90.0  # import torch, initialize CUDA, attach

# The repository's code, installed or not (run_device_checks.sh sets it too).
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        [os.path.join(ROOT, "client"), ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]
    ),
}


def _arena_bytes() -> int:
    """The SHM arena: 128 MiB, less where /dev/shm is small (containers get 64 MB)."""
    from relayd.preflight import SHM_MARGIN, shm_free_bytes

    try:
        free = shm_free_bytes()
    except OSError:
        return 128 * MiB
    return max(16 * MiB, min(128 * MiB, (free - SHM_MARGIN - 8 * MiB) & ~(MiB - 1)))


ARENA = _arena_bytes()


def _memlock_allows_pinning(need: int) -> bool:
    """Raise RLIMIT_MEMLOCK to its hard limit (inherited by the daemon and stages);
    True when that covers the arena, as preflight requires for pinning."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and soft < need:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
            soft = hard
    return bool(soft == resource.RLIM_INFINITY or soft >= need)


PIN = _memlock_allows_pinning(ARENA)


class Stage:
    """One stage process speaking JSON lines; started without waiting (see :func:`_stages`)."""

    def __init__(self, socket: str, stage: str, *, cuda_first: bool, device: int = 0) -> None:
        self.stage = stage
        args = [sys.executable, "-m", "tests.gpu._gpu_worker", "--socket", socket, "--stage", stage]
        if cuda_first:
            args += ["--cuda-first", "--device", str(device)]
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=ENV
        )
        _SPAWNED.append(self.proc)
        self._lines: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, b""):
            self._lines.put(line)
        self._lines.put(b"")  # EOF: the process is gone

    def ready(self) -> Stage:
        assert self.call_raw(READY_TIMEOUT) == {"ready": True}
        return self

    def call_raw(self, timeout: float = CALL_TIMEOUT) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"stage {self.stage} gave no answer within {timeout:.0f} s"
            ) from None
        if not line:
            raise AssertionError(f"stage {self.stage} exited with {self.proc.wait(10)}")
        return dict(json.loads(line))

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def call(self, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        answer = self.call_raw()
        assert "error" not in answer, f"{self.stage}: {answer['error']}"
        return answer

    def call_error(self, **cmd: Any) -> str:
        """The error a command must fail with (``"StaleRefError: ..."``)."""
        self.send(**cmd)
        answer = self.call_raw()
        assert "error" in answer, f"{self.stage}: {cmd['op']} should have failed: {answer}"
        return str(answer["error"])

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def _stages(d: Daemon, *specs: tuple[Any, ...]) -> list[Stage]:
    """Start stage processes side by side (``(name, cuda_first[, device])``), then
    wait until each has attached, in order."""
    stages = [Stage(d.socket, name, cuda_first=cuda, device=dev) for name, cuda, dev in
              (tuple(s) + (0,) * (3 - len(s)) for s in specs)]  # fmt: skip
    return [s.ready() for s in stages]


@pytest.fixture(scope="module")
def gpu_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    pin = [] if PIN else ["--pin-host-memory", "off"]
    d = Daemon(
        str(tmp_path_factory.mktemp("gpu")),
        "--gpu-pool-size", str(GPU_POOL), "--lease-ttl", "3", *pin,
        pool=str(ARENA), env=ENV,
    )  # fmt: skip
    started = False
    try:
        d.start()
        assert d.proc is not None
        _DAEMONS.remove(d.proc)  # outlives each test: the per-test reaper must leave it alone
        started = True
        yield d
        # Shutdown frees the GPU pools (CudaPool.close): it must end cleanly too.
        rc = d.stop()
        assert rc == 0, f"relayd exited with {rc} on SIGTERM:\n{d.log()}"
    finally:
        try:
            if started:
                d.stop()  # no-op when stopped above
        finally:
            logs = os.environ.get("RELAYD_GPU_LOGDIR")
            if logs:
                os.makedirs(logs, exist_ok=True)
                with contextlib.suppress(OSError):
                    shutil.copy(d.log_path, os.path.join(logs, "gpu-daemon.log"))


def _quiet(d: Daemon) -> bool:
    st = d.status()
    return not st.get("sessions") and all(
        int(p["used_bytes"]) == 0 and int(p["granted_bytes"]) == 0 for p in _gpu_pools(d, st)
    )


@pytest.fixture
def daemon(gpu_daemon: Daemon) -> Daemon:
    assert gpu_daemon.proc is not None
    if gpu_daemon.proc.poll() is not None:
        pytest.fail(f"relayd exited with {gpu_daemon.proc.returncode}:\n{gpu_daemon.log()}")
    wait_until(lambda: _quiet(gpu_daemon), 20, "the previous test's sessions and GPU leases to go")
    return gpu_daemon


def _gpu_pools(d: Daemon, status: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    st = d.status() if status is None else status
    return [p for p in st["pools"] if str(p["name"]).startswith("cuda:")]


def _pool_used(d: Daemon) -> int:
    return sum(int(p["used_bytes"]) for p in _gpu_pools(d))


def _drained(d: Daemon) -> bool:
    st = d.status()
    leases = [x for x in st.get("leases", []) if str(x.get("pool", "")).startswith("cuda:")]
    return not leases and all(int(p["used_bytes"]) == 0 for p in _gpu_pools(d, st))


def _round_trip(
    w: Stage, r: Stage, nbytes: int, seed: int, where: str = "cuda", heavy: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Put, get, then compare SHA-256 digests (the writer's taken after the get)."""
    rid = f"r{seed}"
    put = w.call(op="put", to=r.stage, rid=rid, seed=seed, nbytes=nbytes, where=where,
                 heavy=heavy)  # fmt: skip
    got = r.call(op="get", ref=put["ref"])
    want = w.call(op="digest", rid=rid)["digest"]
    assert got["digest"] == want, f"bytes differ at {nbytes} B ({put['transport']})"
    return put, got


def test_daemon_exports_one_pool_per_gpu(daemon: Daemon) -> None:
    pools = _gpu_pools(daemon)
    assert len(pools) == torch.cuda.device_count()
    for p in pools:
        assert int(p["capacity_bytes"]) == GPU_POOL and int(p["used_bytes"]) == 0
        assert int(p["largest_free_run_bytes"]) == GPU_POOL


def test_pool_round_trip_same_gpu_and_one_import_per_process(daemon: Daemon) -> None:
    # The reader first: a writer whose reader is not attached yet gets shm.
    r, w = _stages(daemon, ("pool-talker", True), ("pool-thinker", False))
    sizes = (256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 300 * KiB + 7)
    refs = []
    for i, n in enumerate(sizes):
        put, got = _round_trip(w, r, n, seed=i)
        assert put["transport"] == "cuda_ipc_pool" and got["devices"] == ["cuda", "cuda"]
        refs.append(put["ref"])
    assert w.call(op="facts")["pool_imports"] == 1
    assert r.call(op="facts")["pool_imports"] == 1
    wait_until(lambda: _drained(daemon), 10, "GPU pool to drain")
    # A DataRef is read once: its lease is gone, and the reader says so.
    assert r.call_error(op="get", ref=refs[0]).startswith("StaleRefError")


def test_direct_round_trip(daemon: Daemon) -> None:
    w, r = _stages(daemon, ("direct-thinker", True), ("direct-talker", True))
    for i, n in enumerate((256 * KiB, 8 * MiB, 64 * MiB)):
        put, got = _round_trip(w, r, n, seed=100 + i)
        assert put["transport"] == "cuda_ipc_direct" and got["devices"] == ["cuda", "cuda"]
    assert _pool_used(daemon) == 0  # no pool, no lease


def test_gpu_to_cpu_reader_gets_cpu_tensors(daemon: Daemon) -> None:
    w, r = _stages(daemon, ("g2c-thinker", True), ("g2c-talker", False))
    put, got = _round_trip(w, r, 4 * MiB, seed=200)
    assert put["transport"] == "shm" and got["devices"] == ["cpu", "cpu"]
    assert r.call(op="facts")["cuda"] is False  # a CPU stage never creates a CUDA context


def test_cpu_to_gpu_and_mixed_payloads(daemon: Daemon) -> None:
    w, r = _stages(daemon, ("c2g-thinker", True), ("c2g-talker", True))
    put, got = _round_trip(w, r, 4 * MiB, seed=300, where="cpu")
    assert put["transport"] == "shm" and got["devices"] == ["cpu", "cpu"]  # CPU leaves stay CPU
    put, got = _round_trip(w, r, 4 * MiB, seed=301, where="mixed")
    # sorted keys: cpu, extra, hidden -> CPU leaf on CPU, CUDA leaves on the GPU
    assert put["transport"] == "shm" and got["devices"] == ["cpu", "cuda", "cuda"]
    assert r.call(op="facts")["pinned"] is PIN  # arena page-locked: H2D is DMA


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_pool_round_trip_across_gpus(daemon: Daemon) -> None:
    r, w = _stages(daemon, ("xgpu-talker", True, 1), ("xgpu-thinker", True, 0))
    for i, n in enumerate((256 * KiB, 16 * MiB)):
        put, got = _round_trip(w, r, n, seed=400 + i)
        assert put["transport"] in ("cuda_ipc_pool", "shm")  # shm where no peer access
        assert got["devices"] == ["cuda", "cuda"]


def test_reader_never_sees_a_half_written_lease(daemon: Daemon) -> None:
    r, w = _stages(daemon, ("order-talker", True), ("order-thinker", False))
    pending = []
    for i in range(6):
        # The source is a matmul chain still running when put() enqueues its
        # copy and hands the DataRef out; the reader must wait for the event.
        put, _ = _round_trip(w, r, 32 * MiB, seed=500 + i, heavy=True)
        assert put["transport"] == "cuda_ipc_pool"
        pending.append(put["pending"])
    assert any(pending), "the writer's GPU was idle at every hand-off: nothing was tested"


def test_kill_9_writer_and_reader_returns_the_pool_to_zero(daemon: Daemon) -> None:
    r, w = _stages(daemon, ("kill-talker", True), ("kill-thinker", False))
    refs = []
    for i in range(6):
        put = w.call(op="put", to=r.stage, rid=f"k{i}", seed=600 + i, nbytes=8 * MiB)
        assert put["transport"] == "cuda_ipc_pool"
        refs.append(put["ref"])
    wait_until(lambda: _pool_used(daemon) >= 6 * 8 * MiB, 10, "six published leases")
    w.kill()
    for ref in refs[:3]:
        r.send(op="get", ref=ref)  # in flight when it dies: some claimed, some not
    r.kill()
    wait_until(
        lambda: _drained(daemon) and _quiet(daemon),
        15,
        "the GPU pool to be reclaimed after kill -9 (TTL 3 s)",
    )
    # The pool still works for the next pair.
    r2, w2 = _stages(daemon, ("kill-talker2", True), ("kill-thinker2", False))
    put, _ = _round_trip(w2, r2, 8 * MiB, seed=700)
    assert put["transport"] == "cuda_ipc_pool"
    wait_until(lambda: _drained(daemon), 10, "GPU pool to drain")
