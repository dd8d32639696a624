"""Tests that drive sglang-omni's and vllm-omni's own code.

They run in the second environment, ``.venv-frameworks`` (built by
``scripts/frameworks-env.sh``; ``scripts/test.sh`` runs them). Elsewhere they
are not collected; with ``RELAYD_TEST_FRAMEWORKS=1`` (as ``scripts/test.sh``
sets) a missing framework is an error, never a silent skip.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings

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
else:
    # The frameworks' own imports warn (deprecations in vLLM, torch.jit ...);
    # import them once here with that silenced, so that warnings stay errors
    # for everything the tests do afterwards.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in (
            "vllm_omni.distributed.omni_connectors",
            "vllm_omni.distributed.omni_connectors.adapter",
            "vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter",
            "vllm_omni.plugins",
            "sglang_omni.comm.engine",
            "sglang_omni.pipeline.stage.runtime",
        ):
            importlib.import_module(module)
