"""The framework integrations are optional: importing them pulls in no framework,
and the client distribution declares their extras and vllm-omni's entry point."""

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
import relayd_client.integrations.vllm_omni as v
assert callable(v.register)
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


def test_client_declares_extras_and_entry_point() -> None:
    with open(os.path.join(ROOT, "client", "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    extras = project["optional-dependencies"]
    assert extras["sglang-omni"] == ["sglang-omni==0.1.9"]
    assert extras["vllm-omni"] == ["vllm-omni==0.30.0"]
    plugins = project["entry-points"]["vllm_omni.general_plugins"]
    assert plugins == {"relayd": "relayd_client.integrations.vllm_omni:register"}
