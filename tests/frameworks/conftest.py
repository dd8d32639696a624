"""Tests that drive sglang-omni's and vllm-omni's own code.

They run in the second environment, ``.venv-frameworks`` (built by
``scripts/frameworks-env.sh``; ``scripts/test.sh`` runs them). Elsewhere they
are not collected; with ``RELAYD_TEST_FRAMEWORKS=1`` (as ``scripts/test.sh``
sets) a missing framework is an error, never a silent skip.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

FRAMEWORKS = ("sglang_omni", "vllm_omni")
_missing = [m for m in FRAMEWORKS if importlib.util.find_spec(m) is None]

if _missing:
    if os.environ.get("RELAYD_TEST_FRAMEWORKS"):
        raise pytest.UsageError(
            f"{', '.join(_missing)} not installed: run these tests with .venv-frameworks "
            "(scripts/frameworks-env.sh builds it)"
        )
    collect_ignore_glob = ["test_*.py"]
