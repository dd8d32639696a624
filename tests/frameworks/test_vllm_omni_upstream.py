"""vllm-omni's own connector tests (its 0.20.0 source distribution, fetched from
the package registry at test time) run against RelaydConnector; see
_upstream_plugin.py for which ones and why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._daemon import Daemon, running_daemon
from tests.frameworks._procs import ROOT
from tests.frameworks._upstream_plugin import CONTRACT

pytestmark = pytest.mark.timeout(900)

SDIST = "vllm-omni==0.20.0"
TESTS_IN_SDIST = "tests/distributed/omni_connectors/"
FILES = sorted({name.split("::", 1)[0] for name in CONTRACT})


@pytest.fixture(scope="module")
def upstream_tests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The connector test files of vllm-omni's source distribution, unpacked."""
    where = tmp_path_factory.mktemp("vllm-omni-sdist")
    cp = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-cache-dir",
         "--no-binary", ":all:", SDIST, "-d", str(where)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert cp.returncode == 0, cp.stderr[-3000:]
    (sdist,) = where.glob("vllm_omni-*.tar.gz")
    out = where / "tests"
    out.mkdir()
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            path, _, name = member.name.partition("/")[2].rpartition("/")
            if f"{path}/" == TESTS_IN_SDIST and name in FILES and member.isfile():
                f = tar.extractfile(member)
                assert f is not None
                (out / name).write_bytes(f.read())
    assert sorted(p.name for p in out.iterdir()) == FILES
    return out


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    with running_daemon(str(tmp_path)) as d:
        yield d


def test_vllm_omni_connector_contract_tests_pass(
    upstream_tests: Path, daemon: Daemon, tmp_path: Path
) -> None:
    """Every contract test selected from the sdist runs against RelaydConnector and passes."""
    report = tmp_path / "report.json"
    env = {**os.environ, "RELAYD_SOCKET": daemon.socket, "RELAYD_UPSTREAM_REPORT": str(report)}
    cp = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-p", "tests.frameworks._upstream_plugin", "-c", os.devnull,
         "--rootdir", str(upstream_tests), *[str(upstream_tests / f) for f in FILES]],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    out = cp.stdout[-6000:] + cp.stderr[-3000:]
    assert cp.returncode == 0, out
    ran = json.loads(report.read_text())
    assert ran["failed"] == [], out
    assert sorted(ran["passed"]) == sorted(CONTRACT), out
    assert ran["built"] == len(CONTRACT), out  # each test built its own RelaydConnector
