"""The device check's own tools, on a machine without a GPU (runs in CI).

``scripts/gpu-wheels.sh`` fetches the wheels a bare GPU machine lacks (this
needs the package index); ``tests/gpu/run_device_checks.sh`` installs them
offline into a private directory, prints the versions in effect, and its
two-process smoke test reports "no CUDA device" here, writes summary.md and
stops with exit 2 before the GPU tests and the benchmark.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "client" / "relayd_client" / "wire" / "proto"
CHECK = ROOT / "tests" / "gpu" / "run_device_checks.sh"
WHEELS = ROOT / "scripts" / "gpu-wheels.sh"


def _generated_versions() -> tuple[str, str]:
    grpc = re.search(
        r"GRPC_GENERATED_VERSION = '([0-9.]+)'", (PROTO / "relay_pb2_grpc.py").read_text()
    )
    proto = re.search(r"Protobuf Python Version: ([0-9.]+)", (PROTO / "relay_pb2.py").read_text())
    assert grpc and proto
    return grpc.group(1), proto.group(1)


def _download(dest: Path, py_version: str) -> list[str]:
    env = {**os.environ, "PYTHON": sys.executable, "PY_VERSION": py_version}
    proc = subprocess.run(
        ["bash", str(WHEELS), str(dest)], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return sorted(p.name for p in dest.glob("*.whl"))


def _run_check(tmp_path: Path, wheels: Path) -> tuple[int, str, str]:
    out, site = tmp_path / "out", tmp_path / "site"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "GPU_WHEELS": str(wheels),
        "GPU_SITE": str(site),
        "PIP_INDEX_URL": "http://127.0.0.1:9/unreachable",  # offline means offline
    }
    env.pop("OUT", None)
    proc = subprocess.run(
        ["bash", str(CHECK), str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    summary = (out / "summary.md").read_text()
    install = (out / "install.txt").read_text()
    assert not (out / "gpu-tests.log").exists(), "GPU tests ran without a CUDA device"
    return proc.returncode, summary, install


def test_gpu_wheels_fetches_cp312_manylinux_wheels_at_the_generated_versions(
    tmp_path: Path,
) -> None:
    grpc, proto = _generated_versions()
    names = _download(tmp_path / "w", "3.12")
    assert f"grpcio_health_checking-{grpc}-py3-none-any.whl" in names
    assert any(
        re.fullmatch(rf"grpcio-{re.escape(grpc)}-cp312-cp312-.*manylinux.*x86_64\.whl", n)
        for n in names
    ), names
    assert any(
        re.fullmatch(rf"protobuf-{re.escape(proto)}-.*(manylinux.*x86_64|none-any)\.whl", n)
        for n in names
    ), names
    assert any(n.startswith("prometheus_client-") for n in names)
    assert any(re.match(r"uvloop-.*cp312.*manylinux.*x86_64\.whl", n) for n in names), names
    assert not any(n.startswith(("torch-", "nvidia_")) for n in names)  # the machine's torch stays


def test_offline_install_then_no_cuda_finding(tmp_path: Path) -> None:
    # The real wheels, for this interpreter, installed with no index reachable.
    wheels = tmp_path / "wheels"
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    _download(wheels, py)
    rc, summary, install = _run_check(tmp_path, wheels)
    assert rc == 2, summary
    assert "offline install: ok" in install
    site = str(tmp_path / "site")
    for dist in ("grpcio-health-checking", "grpcio", "protobuf"):
        line = next(ln for ln in install.splitlines() if ln.startswith(f"version {dist} "))
        assert site in line, f"{dist} was not taken from the private directory: {line}"
    assert "**no CUDA device: a CPU build of torch" in summary
    assert "**NO CUDA DEVICE**: GPU tests and benchmark not run." in summary


def _tiny_wheel(dest: Path) -> Path:
    """A one-module wheel: the install step without any index or download."""
    dest.mkdir()
    path = dest / "relayd_gpu_probe-1.0-py3-none-any.whl"
    info = "relayd_gpu_probe-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("relayd_gpu_probe.py", '__version__ = "1.0"\n')
        z.writestr(
            f"{info}/METADATA", "Metadata-Version: 2.1\nName: relayd-gpu-probe\nVersion: 1.0\n"
        )
        z.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(f"{info}/RECORD", "")
    return dest


def test_offline_install_of_a_local_wheel_and_summary_without_cuda(tmp_path: Path) -> None:
    rc, summary, install = _run_check(tmp_path, _tiny_wheel(tmp_path / "wheels"))
    assert rc == 2
    assert "installing 1 wheels offline" in install and "offline install: ok" in install
    assert (tmp_path / "site" / "relayd_gpu_probe.py").is_file()
    assert re.search(r"version grpcio \S+ from ", install)
    assert "## CUDA IPC smoke test (two processes)" in summary
    assert "no CUDA device" in summary


def test_no_wheels_is_said_not_fatal(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    rc, summary, install = _run_check(tmp_path, tmp_path / "empty")
    assert rc == 2
    assert "no wheels in" in install and "using the machine's packages" in summary
