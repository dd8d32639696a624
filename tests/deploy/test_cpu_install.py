"""The CPU install path cannot resolve to a CUDA build of torch, on any machine.

PyPI's default Linux torch is the CUDA build (it pulls ~20 ``nvidia-*``/``cuda-*``
wheels). ``constraints/cpu.txt`` must name the ``+cpu`` local version, which only
PyTorch's CPU index or a local wheel offers, and every place that installs the
CPU path must use it with that index.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
CONSTRAINT = REPO / "constraints" / "cpu.txt"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# An unreachable index is retried with back-off per package; one attempt each
# keeps an offline run to seconds.
PIP_TIMEOUT = 300
CUDA_PACKAGE = re.compile(r"^(nvidia|cuda)[-_]", re.IGNORECASE)


def _constraint_lines() -> list[str]:
    return [
        line.strip()
        for line in CONSTRAINT.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_cpu_constraint_names_the_cpu_build() -> None:
    pins = [Requirement(line) for line in _constraint_lines()]
    torch = [r for r in pins if r.name == "torch"]
    assert len(torch) == 1, pins
    (spec,) = torch[0].specifier
    assert spec.operator == "==" and spec.version.endswith("+cpu"), str(spec)


def _cpu_install_requirements() -> list[str]:
    """What the CPU install line brings in, minus the two local projects themselves."""
    out: list[str] = []
    for pyproject in (REPO / "pyproject.toml", REPO / "client" / "pyproject.toml"):
        project = tomllib.loads(pyproject.read_text())["project"]
        deps = list(project["dependencies"])
        deps += project.get("optional-dependencies", {}).get("mooncake", [])
        out += [d for d in deps if not Requirement(d).name.startswith("relayd")]
    return sorted(set(out))


def test_cpu_dry_run_installs_no_cuda_package(tmp_path: Path) -> None:
    """pip resolves the CPU install's dependencies to torch +cpu and no CUDA wheel."""
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--disable-pip-version-check",
            "--retries",
            "0",
            "--timeout",
            "15",
            "--report",
            str(report),
            "-c",
            str(CONSTRAINT),
            "--extra-index-url",
            CPU_INDEX,
            *_cpu_install_requirements(),
        ],
        capture_output=True,
        text=True,
        timeout=PIP_TIMEOUT,
        check=False,
    )
    if proc.returncode != 0:
        # Refusing is the other acceptable outcome: no source of the +cpu wheel.
        assert re.search(r"No matching distribution found for torch==[\w.]+\+cpu", proc.stderr), (
            proc.stderr[-3000:]
        )
        pytest.skip("neither PyTorch's CPU index nor a local +cpu wheel is reachable here")
    installed = {
        item["metadata"]["name"]: item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert installed.get("torch", "").endswith("+cpu"), installed
    assert not [name for name in installed if CUDA_PACKAGE.match(name)], sorted(installed)


def test_cpu_install_lines_use_the_cpu_index() -> None:
    """Every documented CPU install names the constraint together with PyTorch's CPU index."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"<!-- install:begin -->(.*?)<!-- install:end -->", readme, re.DOTALL)
    assert block
    cpu_lines = [line for line in block.group(1).splitlines() if "constraints/cpu.txt" in line]
    assert cpu_lines and all(f"--extra-index-url {CPU_INDEX}" in line for line in cpu_lines)

    deploy_readme = (REPO / "deploy" / "README.md").read_text()
    assert "-c constraints/cpu.txt" in deploy_readme and CPU_INDEX in deploy_readme
    assert "PIP_CONSTRAINT=constraints/cpu.txt" in (REPO / "Dockerfile").read_text()
    assert f"PIP_EXTRA_INDEX_URL={CPU_INDEX}" in (REPO / "Dockerfile").read_text()
    helper = (REPO / "scripts" / "_pip_cpu.sh").read_text()
    assert CPU_INDEX in helper and "constraints/cpu.txt" in helper
    for script in ("test.sh", "demo.sh"):
        text = (REPO / "scripts" / script).read_text()
        assert ". scripts/_pip_cpu.sh" in text and '"${PIP_CPU_ARGS[@]}"' in text, script


def test_client_declares_numpy() -> None:
    """torch declares numpy optional and warns "Failed to initialize NumPy" at every
    import without it; every install of the client (and so of relayd) brings it."""
    project = tomllib.loads((REPO / "client" / "pyproject.toml").read_text())["project"]
    assert "numpy" in {Requirement(d).name for d in project["dependencies"]}
