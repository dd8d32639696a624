"""pytest plugin: vllm-omni's own connector tests, pointed at RelaydConnector.

``test_vllm_omni_upstream.py`` runs the test files of vllm-omni's source
distribution (downloaded at test time, never copied here) in a separate
pytest with ``-p tests.frameworks._upstream_plugin``. The plugin keeps the
tests that are about the connector contract - put/get by key, ``None`` for a
missing key, metadata of other transports ignored, rank keys independent,
the orchestrator's send/receive flow - and deselects the rest, each for the
reason noted. The kept modules build their connector as
``SharedMemoryConnector(config)``; that name is rebound to build a
``RelaydConnector`` on the daemon at ``RELAYD_SOCKET`` instead. What ran is
written as JSON to ``RELAYD_UPSTREAM_REPORT``.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

import pytest

# file::test -> why it is about the contract every connector keeps.
CONTRACT = {
    "test_shm_connector.py::TestKeyBasedReadWrite::test_get_nonexistent_key_returns_none": "get of a missing key is None",
    "test_shm_connector.py::TestKeyBasedReadWrite::test_rank_aware_keys_independent": "TP rank keys",
    "test_shm_connector.py::TestMetadataFallback::test_rdma_style_metadata_falls_back_to_key": "key wins over foreign metadata",
    "test_shm_connector.py::TestMetadataFallback::test_non_dict_metadata_falls_back_to_key": "key wins over foreign metadata",
    "test_shm_connector.py::TestMetadataFallback::test_empty_dict_metadata_falls_back_to_key": "key wins over foreign metadata",
    "test_shm_connector.py::TestMetadataFallback::test_shm_handle_metadata_still_works": "put's own metadata accepted",
    "test_shm_connector.py::TestMetadataFallback::test_metadata_keyed_by_request_id": "wrapped metadata accepted",
    "test_shm_connector.py::TestHeteroTPMultiKey::test_receiver_reads_multiple_sender_keys": "TP 2 -> 1 keys",
    "test_shm_connector.py::TestHeteroTPMultiKey::test_sender_writes_multiple_receiver_keys": "TP 1 -> 2 keys",
    "test_basic_connectors.py::test_get_invalid_metadata": "unknown metadata, no put: None",
    "test_adapter_and_flow.py::test_shm_connector_flow": "try_send -> try_recv through a real connector",
}
# Deselected: they inspect SharedMemoryConnector's internals (its _pending_keys
# bookkeeping, an "shm" handle in the metadata, mocked shm_write_bytes),
# exercise another connector (Mooncake) or no connector at all (serializer,
# config files, mocks).

_built = itertools.count(1)
_report: dict[str, Any] = {"built": 0, "passed": [], "failed": []}


def _relayd_connector(config: dict[str, Any] | None = None) -> Any:
    from relayd_client.integrations.vllm_omni import RelaydConnector

    n = next(_built)
    _report["built"] = n
    # Stage names of their own per connector: tests reuse keys across tests.
    extra = {**(config or {}), "socket": os.environ["RELAYD_SOCKET"], "stage": f"upstream{n}"}
    return RelaydConnector(extra)


def _name(item: pytest.Item) -> str:
    return f"{item.path.name}::{item.nodeid.split('::', 1)[1]}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep = [i for i in items if _name(i) in CONTRACT]
    drop = [i for i in items if _name(i) not in CONTRACT]
    items[:] = keep
    config.hook.pytest_deselected(items=drop)
    for item in keep:
        module = item.module  # type: ignore[attr-defined]
        if hasattr(module, "SharedMemoryConnector"):
            module.SharedMemoryConnector = _relayd_connector


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome == "failed":
        name = report.nodeid.rsplit("/", 1)[-1]
        _report["passed" if report.passed else "failed"].append(name)


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("RELAYD_UPSTREAM_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(_report, f)
