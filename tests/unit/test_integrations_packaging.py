"""The framework integrations are optional: importing them pulls in no framework,
and the client distribution declares their extras."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"sglang_omni", "sglang", "vllm_omni", "vllm", "msgspec"}:
            raise ImportError(f"imported framework module {name}")
sys.meta_path.insert(0, Block())
import relayd_client
import relayd_client.integrations
import relayd_client.integrations.sglang_omni as s
try:
    s.RelaydRelay
except ImportError as exc:
    assert "sglang_omni" in str(exc), exc
else:
    raise AssertionError("RelaydRelay resolved without sglang-omni")
print("ok")
"""


def test_integrations_import_no_framework() -> None:
    cp = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0 and cp.stdout.strip() == "ok", cp.stderr


def test_client_declares_extras() -> None:
    with open(os.path.join(ROOT, "client", "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["optional-dependencies"]["sglang-omni"] == ["sglang-omni==0.1.9"]
