"""RelaydConnector under vllm-omni 0.30.0's own connector machinery: its plugin
loader and factory, the orchestrator's try_send/try_recv, the chunk transfer
adapter and its TP rank keys, between processes through a real daemon (see
_vllm_stage.py for what each process does)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from relayd_client.integrations.vllm_omni import RelaydConnector, register
from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec
from vllm_omni.plugins import load_omni_general_plugins

from tests._daemon import Daemon, running_daemon, wait_until
from tests.frameworks._procs import ROOT, Worker

pytestmark = pytest.mark.timeout(300)

STAGE = "tests.frameworks._vllm_stage"
README_SOCKET = "/run/relayd/relayd.sock"
PREFIX = "qwen3-omni"


def readme_config() -> str:
    """The YAML the README tells a vllm-omni user to paste."""
    text = (Path(ROOT) / "README.md").read_text()
    section = text.split("## Using relayd from vllm-omni", 1)[1]
    m = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert m, "README's vllm-omni configuration block not found"
    return m.group(1)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    with running_daemon(str(tmp_path)) as d:
        yield d


@pytest.fixture
def config(tmp_path: Path, daemon: Daemon) -> str:
    text = readme_config()
    assert README_SOCKET in text and f"stage: {PREFIX}" in text
    path = tmp_path / "omni.yaml"
    path.write_text(text.replace(README_SOCKET, daemon.socket))
    return str(path)


def _pair(tmp: Path, config: str, scenario: str) -> tuple[Worker, Worker]:
    def start(role: str) -> Worker:
        args = [role, "--config", config, "--scenario", scenario]
        return Worker(STAGE, args, str(tmp / f"{role}.log"))

    return start("receiver"), start("sender")


def _arena_used(d: Daemon) -> int:
    return d.pool()["used_bytes"]


def test_entry_point_registers_once_and_the_factory_builds_it(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vllm-omni's plugin loader finds the client's entry point; loading it again
    (as every worker process and a second load do) changes nothing."""
    load_omni_general_plugins()
    (ep,) = [e for e in entry_points(group="vllm_omni.general_plugins") if e.name == "relayd"]
    ep.load()()
    register()
    assert OmniConnectorFactory.list_registered_connectors().count("RelaydConnector") == 1
    monkeypatch.setenv("RELAYD_SOCKET", daemon.socket)  # no socket in extra: the client's variable
    conn = OmniConnectorFactory.create_connector(ConnectorSpec("RelaydConnector", {"stage_id": 1}))
    assert isinstance(conn, RelaydConnector) and conn.supports_raw_data
    assert conn.socket == daemon.socket and conn.stage_id == 1
    health = conn.health()
    assert health["status"] == "healthy" and health["node_id"] == daemon.node_id
    assert conn.get("0", "1", "nothing-yet") is None  # no entry: None, not an error
    ok, size, meta = conn.put("0", "1", "raw", torch.arange(1000, dtype=torch.int32))
    assert ok and size >= 4000 and meta is None
    obj, got_size = conn.get("0", "1", "raw")
    assert torch.equal(obj, torch.arange(1000, dtype=torch.int32)) and got_size == size
    conn.close()
    conn.close()


def test_orchestrator_forward_through_try_send_and_try_recv(
    tmp_path: Path, daemon: Daemon, config: str
) -> None:
    """Connectors built from the README's YAML on both ends (orchestrator and stage 1 worker);
    a 64 KiB and a 4 MiB request cross by key, byte-exact, with no metadata."""
    receiver, sender = _pair(tmp_path, config, "forward")
    assert sender.expect("connector") == receiver.expect("connector") == "RelaydConnector"
    assert receiver.expect("stage_id") == 1
    for _ in range(2):
        rec = sender.next_record("notify")
        assert rec["metadata"] is None  # nothing needs to travel with the key
        receiver.send(rec["notify"])
        got = receiver.next_record("got")
        assert got["rx_bytes"] > 0
    sent = sender.expect("sent")
    got_all = {k: v for r in receiver.records if "got" in r for k, v in r["got"].items()}
    assert got_all == sent and None not in sent.values()
    assert sender.expect("forwarded")[1] > 4 << 20
    assert receiver.proc.stdin is not None
    receiver.proc.stdin.close()
    sender.nudge()
    receiver.finish()
    sender.finish()
    wait_until(lambda: _arena_used(daemon) == 0, 30, "the arena to empty")


def test_chunk_adapter_streams_in_order(tmp_path: Path, daemon: Daemon, config: str) -> None:
    """Stage 0's chunk adapter saves 8 chunks (the last one terminal); stage 1's
    polls each key without metadata and commits them in order."""
    receiver, sender = _pair(tmp_path, config, "chunks")
    assert sender.expect("sent") == 8
    assert receiver.expect("got") == receiver.expect("expected")
    assert receiver.expect("codes") == [list(range(k, k + 4)) for k in range(8)]
    assert receiver.expect("done") is True
    sender.nudge()
    receiver.finish()
    sender.finish()
    wait_until(lambda: _arena_used(daemon) == 0, 30, "the arena to empty")


def test_tp_rank_keys_independent_and_cleanup_frees_the_request(
    tmp_path: Path, daemon: Daemon, config: str
) -> None:
    """Each receiver rank (a thread, as in a TP worker) reads exactly its own
    rank-suffixed keys, TP 2->2 and 1->2; a read key is gone; the receiver's
    cleanup("gone") frees the other request's unread chunk and rank keys while
    both processes are still attached."""
    receiver, sender = _pair(tmp_path, config, "ranks")
    sent = sender.expect("sent")
    assert len(sent) == 4 and None not in sent.values()
    assert receiver.expect("got") == sent
    assert receiver.expect("again") is None
    assert _arena_used(daemon) > 0  # the other request's keys, unread
    receiver.nudge()
    assert receiver.expect("cleaned") and receiver.expect("after") == [None, None, None]
    wait_until(lambda: _arena_used(daemon) == 0, 30, f"the arena to empty: {daemon.status()}")
    assert {s["stage"] for s in daemon.status()["stages"]} >= {f"{PREFIX}.0", f"{PREFIX}.1"}
    assert receiver.expect("health")["status"] == "healthy"
    receiver.nudge()
    sender.nudge()
    receiver.finish()
    sender.finish()
