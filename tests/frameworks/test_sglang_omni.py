"""RelaydRelay under sglang-omni 0.1.9's own CommEngine and stage I/O, two stage
processes through a real daemon (see _sglang_stage.py for what each does)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from relayd_client.integrations.sglang_omni import RelaydOperation, RelaydRelay
from sglang_omni.comm.data_ref import TransportKind
from sglang_omni.pipeline.stage.runtime import Stage
from sglang_omni.relay.base import RELAY_REGISTRY, RelayOperation, create_relay

from tests._daemon import Daemon, running_daemon, wait_until
from tests.frameworks._procs import Worker

pytestmark = pytest.mark.timeout(300)

STAGE = "tests.frameworks._sglang_stage"


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    with running_daemon(str(tmp_path)) as d:
        yield d


def _pair(tmp: Path, d: Daemon, scenario: str, *extra: str) -> tuple[Worker, Worker]:
    ep = {s: f"ipc://{tmp}/{s}.ipc" for s in ("thinker", "talker")}

    def start(role: str, peer: str) -> Worker:
        args = [role, "--socket", d.socket, "--me", ep[role], "--peer", ep[peer]]
        return Worker(STAGE, [*args, "--scenario", scenario, *extra], str(tmp / f"{role}.log"))

    return start("talker", "thinker"), start("thinker", "talker")


def _arena_empty(d: Daemon) -> bool:
    st = d.status()
    return d.pool()["used_bytes"] == 0 and not st.get("leases")


def test_registered_and_injected_through_stage(daemon: Daemon) -> None:
    """`create_relay("relayd", ...)` builds it, and `Stage(relay=...)` routes every edge to it."""
    assert RELAY_REGISTRY["relayd"] is RelaydRelay
    relay = create_relay("relayd", stage="talker", socket=daemon.socket, slot_size_mb=64)
    assert isinstance(relay, RelaydRelay) and relay.device == "cpu"
    stage = Stage(
        name="talker",
        role="single",
        get_next=lambda *_: None,
        gpu_id=None,
        endpoints={},
        control_plane=None,
        relay=relay,
    )
    for kind in (TransportKind.SHM, TransportKind.CUDA_IPC, TransportKind.MOONCAKE):
        assert stage.comm.relay(kind) is relay
    assert stage.comm.inbound_relay("thinker") is relay
    assert issubclass(RelaydOperation, RelayOperation)
    relay.close()


def test_pipeline_payloads_and_streams_byte_exact(tmp_path: Path, daemon: Daemon) -> None:
    """A nested payload and a 12-chunk stream (metadata tensors included) arrive
    byte-exact and in order; the talker then sends on the same request after
    sglang-omni's read called relay.cleanup(r1); a payload the talker frees unread
    (discard) goes, and a second discard is StaleRefError; every transfer is
    acknowledged and the arena ends empty."""
    talker, thinker = _pair(tmp_path, daemon, "pipeline")
    sent = thinker.expect("sent_payload")
    assert talker.expect("payload") == sent
    assert talker.expect("order") == list(range(12))
    assert talker.expect("chunks") == thinker.expect("sent_chunks")
    assert thinker.expect("echo") == sent
    assert talker.expect("second_discard") == ["StaleRefError"]  # r3, freed unread once
    assert thinker.expect("settled") and talker.expect("settled")
    thinker.finish()
    talker.finish()
    wait_until(lambda: _arena_empty(daemon), 30, "the arena to empty")


def test_abort_frees_the_request_while_both_stages_live(tmp_path: Path, daemon: Daemon) -> None:
    """The talker aborts r2 (CommEngine.cleanup, as Stage.on_abort) with a 2 MB
    payload and 12 chunks published and unread: the arena is back at zero with
    both sessions still attached, the stage's drain reads nothing, and every
    transfer of the thinker ends on the negative acknowledgements."""
    talker, thinker = _pair(tmp_path, daemon, "abort")
    assert thinker.expect("published")
    assert talker.expect("aborted")
    assert talker.expect("failed") == talker.expect("drained") == 13
    assert thinker.expect("settled")
    wait_until(lambda: _arena_empty(daemon), 30, f"the arena to empty: {daemon.status()}")
    assert {s["stage"] for s in daemon.status()["stages"]} >= {"thinker", "talker"}
    talker.nudge()
    thinker.nudge()
    thinker.finish()
    talker.finish()
    assert os.path.exists(daemon.socket)
