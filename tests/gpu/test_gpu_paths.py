"""GPU paths end to end: the real daemon with GPU pools, real stage processes.

Skipped (and counted as skipped) without a CUDA device. Routes come from the
daemon: a writer that attaches before touching CUDA is a "placement without
GPU", so same-GPU traffic goes through the pool; one that initializes CUDA
first shares the reader's GPU, and gets cuda_ipc_direct only if it opted in
(``--direct``), else the pool. A reader must be attached before the put, or
the daemon routes through shm (reader unknown).

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
from tests._figures import record  # noqa: E402

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

    def __init__(
        self, socket: str, stage: str, *, cuda_first: bool, device: int = 0, direct: bool = False
    ) -> None:
        self.stage = stage
        args = [sys.executable, "-m", "tests.gpu._gpu_worker", "--socket", socket, "--stage", stage]
        if cuda_first:
            args += ["--cuda-first", "--device", str(device)]
        if direct:
            args += ["--direct"]
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
    """Start stage processes side by side (``(name, cuda_first[, device[, direct]])``),
    then wait until each has attached, in order."""
    stages = [Stage(d.socket, name, cuda_first=cuda, device=dev, direct=direct)
              for name, cuda, dev, direct in
              ((tuple(s) + (0, False)[len(s) - 2:])[:4] for s in specs)]  # fmt: skip
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
    w, r = _stages(daemon, ("direct-thinker", True, 0, True), ("direct-talker", True))
    for i, n in enumerate((256 * KiB, 8 * MiB, 64 * MiB)):
        put, got = _round_trip(w, r, n, seed=100 + i)
        assert put["transport"] == "cuda_ipc_direct" and got["devices"] == ["cuda", "cuda"]
    assert _pool_used(daemon) == 0  # no pool, no lease


def test_same_gpu_uses_the_pool_unless_the_writer_opts_into_direct(daemon: Daemon) -> None:
    w, r = _stages(daemon, ("nodirect-thinker", True), ("nodirect-talker", True))
    put, got = _round_trip(w, r, 1 * MiB, seed=150)
    assert put["transport"] == "cuda_ipc_pool" and got["devices"] == ["cuda", "cuda"]


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


# -- issue: what a reading against PyTorch's IPC rules found ----------------------------


def test_shm_put_from_a_side_stream_producer_on_a_worker_thread_is_exact(daemon: Daemon) -> None:
    """GPU -> CPU through shm at >= 8 MiB: the device-to-host copy runs on a
    worker thread, which must run it after the producer's side stream."""
    from relayd_client._writer import OFFLOAD_BYTES

    w, r = _stages(daemon, ("side-thinker", True), ("side-talker", False))
    pending = []
    for i, n in enumerate((OFFLOAD_BYTES, 32 * MiB + 5)):
        rid = f"side{i}"
        put = w.call(op="put", to=r.stage, rid=rid, seed=800 + i, nbytes=n, heavy=True, side=True)
        assert put["transport"] == "shm"
        pending.append(put["pending"])
        got = r.call(op="get", ref=put["ref"])
        assert got["digest"] == w.call(op="digest", rid=rid)["digest"], f"stale bytes at {n} B"
    # The put waits for its copy; "pending" only says the side stream was busy before.
    record("shm side-stream put: side stream still busy after put", str(pending))


def test_direct_busy_writer_dropped_tensors_read_twice_and_2000_puts(daemon: Daemon) -> None:
    from tests.gpu._gpu_worker import expected_digest

    w, r = _stages(daemon, ("d2-thinker", True, 0, True), ("d2-talker", True))
    # The writer's GPU still busy when the reader reads.
    put, _got = _round_trip(w, r, 32 * MiB, seed=900, heavy=True)
    assert put["transport"] == "cuda_ipc_direct"
    # The writer drops its tensors right after put: PyTorch's count keeps the block.
    put = w.call(op="put", to=r.stage, rid="d2-drop", seed=901, nbytes=4 * MiB, keep=False)
    assert put["transport"] == "cuda_ipc_direct"
    assert r.call(op="get", ref=put["ref"])["digest"] == expected_digest(901, 4 * MiB)
    # The same ref read twice: refused, before PyTorch's count is released again.
    assert r.call_error(op="get", ref=put["ref"]).startswith("StaleRefError")
    # 2,000 direct puts, each read once, in rounds of 200 (a pipeline reads what
    # it is handed; PyTorch syncs every share past ~1,000 unread): the writer's
    # memory comes back, and puts stay flat.
    size, rounds = 64 * KiB, []
    for k in range(10):
        many = w.call(op="put_many", to=r.stage, rid=f"d2m{k}", n=200, nbytes=size)
        assert many["transports"] == ["cuda_ipc_direct"]
        digests = r.call(op="get_many", refs=many["refs"])["digests"]
        assert digests == [expected_digest(i, size) for i in range(200)], f"round {k}"
        rounds.append(many)
    after = w.call(op="drop_kept")
    grown = after["allocated"] - rounds[0]["before"]["allocated"]
    record(
        "direct 2000 puts",
        f"put median first/last 200: {rounds[0]['first_ms']:.3f}/{rounds[-1]['last_ms']:.3f} ms; "
        f"writer allocated +{grown} B after release",
    )
    assert grown <= 2 * MiB, f"the writer kept {grown} B after every ref was read once"


def test_2000_same_gpu_puts_aborted_unread_leak_nothing(daemon: Daemon) -> None:
    """The default for a same-GPU edge is the pool: an unread, aborted put frees
    its lease, and the writer's memory is untouched (no PyTorch IPC count)."""
    w, r = _stages(daemon, ("ab-thinker", True), ("ab-talker", True))
    many = w.call(op="put_many", to=r.stage, rid="ab", n=2000, nbytes=64 * KiB, abort=True)
    assert many["transports"] == ["cuda_ipc_pool"]
    grown = many["after"]["allocated"] - many["before"]["allocated"]
    free_drop = many["before"]["free"] - many["after"]["free"]
    record(
        "pool 2000 aborted puts",
        f"put median first/last 200: {many['first_ms']:.3f}/{many['last_ms']:.3f} ms; "
        f"writer allocated +{grown} B, device free -{free_drop} B",
    )
    assert grown <= 2 * MiB
    wait_until(lambda: _drained(daemon), 10, "GPU pool to drain after the aborts")


def test_pool_writer_closes_with_its_copy_queued(daemon: Daemon) -> None:
    r, w = _stages(daemon, ("close-talker", True), ("close-thinker", False))
    put = w.call(op="put", to=r.stage, rid="c1", seed=1000, nbytes=32 * MiB, heavy=True)
    assert put["transport"] == "cuda_ipc_pool"
    assert w.call(op="close") == {"closed": True}  # settles its copies, then goes
    # Its event goes with it: the lease is reclaimed, never served.
    err = r.call_error(op="get", ref=put["ref"])
    assert err.startswith("StaleRefError"), err
    wait_until(lambda: _drained(daemon), 10, "GPU pool to drain after the writer closed")


def test_pool_writer_killed_with_its_copy_queued(daemon: Daemon) -> None:
    r, w = _stages(daemon, ("kq-talker", True), ("kq-thinker", False))
    put = w.call(op="put", to=r.stage, rid="kq1", seed=1100, nbytes=32 * MiB, heavy=True)
    assert put["transport"] == "cuda_ipc_pool"
    w.kill()
    wait_until(
        lambda: len(daemon.status().get("sessions", [])) == 1, 10, "the writer's session to end"
    )
    err = r.call_error(op="get", ref=put["ref"])  # within CALL_TIMEOUT: never a hang
    assert err.startswith("StaleRefError"), err
    wait_until(lambda: _drained(daemon), 10, "GPU pool to drain after the writer died")


def test_writers_and_readers_random_sizes_aborts_and_slot_reuse(daemon: Daemon) -> None:
    import random

    r1, r2, w1, w2 = _stages(
        daemon, ("mx-talker1", True), ("mx-talker2", True), ("mx-thinker1", False),
        ("mx-thinker2", False),
    )  # fmt: skip
    rng = random.Random(18)
    sizes = (64 * KiB, 300 * KiB + 7, 1 * MiB, 3 * MiB + 1, 8 * MiB + 3)
    checked = aborted = 0
    for i in range(40):
        w, r = (w1, w2)[i % 2], (r1, r2)[(i // 2) % 2]
        n, rid = rng.choice(sizes), f"mx{i}"
        put = w.call(op="put", to=r.stage, rid=rid, seed=1200 + i, nbytes=n, heavy=i % 9 == 0)
        assert put["transport"] == "cuda_ipc_pool"
        if rng.random() < 0.25:
            w.call(op="abort", rid=rid)
            err = r.call_error(op="get", ref=put["ref"])
            assert err.startswith(("AbortedError", "StaleRefError")), err
            w.call(op="digest", rid=rid)  # drop it
            aborted += 1
            continue
        got = r.call(op="get", ref=put["ref"])
        assert got["digest"] == w.call(op="digest", rid=rid)["digest"], f"bytes differ: put {i}"
        checked += 1
    assert checked and aborted
    wait_until(lambda: _drained(daemon), 10, "GPU pool to drain")


def test_daemon_restart_gives_the_old_pools_gpu_memory_back(
    tmp_path_factory: pytest.TempPathFactory, gpu_daemon: Daemon
) -> None:
    pin = [] if PIN else ["--pin-host-memory", "off"]
    d = Daemon(
        str(tmp_path_factory.mktemp("restart")),
        "--gpu-pool-size", str(GPU_POOL), *pin,
        pool=str(ARENA), env=ENV, node_id="gpurestart",
    )  # fmt: skip
    d.start()
    try:
        r, w = _stages(d, ("rs-talker", True), ("rs-thinker", False))
        put, _ = _round_trip(w, r, 1 * MiB, seed=1300)
        assert put["transport"] == "cuda_ipc_pool"  # both processes imported the pool
        before = r.call(op="mem")["free"]
        assert d.stop() == 0
        d.start()  # a new epoch, a new pool
        # The reader first, as at the start: a writer whose reader has not
        # re-attached yet is routed to shm (its consumer is unknown).
        assert r.call(op="status")["epoch"] == w.call(op="status")["epoch"]
        put, _ = _round_trip(w, r, 1 * MiB, seed=1301)  # re-attached, new pool imported
        assert put["transport"] == "cuda_ipc_pool"
        after = r.call(op="mem")["free"]
        record("daemon restart", f"device free before {before} B, after {after} B")
        # The old epoch's pool would still be held by both clients' mappings.
        assert before - after < GPU_POOL // 2, f"{before - after} B not given back"
    finally:
        d.stop()
