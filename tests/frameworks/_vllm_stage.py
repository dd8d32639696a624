"""One vllm-omni process driving its connector machinery over RelaydConnector.

``python -m tests.frameworks._vllm_stage ROLE --config YAML --scenario S``

Connectors come from vllm-omni's own plugin loader (the client's
``vllm_omni.general_plugins`` entry point) and its factory, configured by the
YAML the test writes. Each process prints JSON lines; the test carries the
orchestrator's queue notifications from the sender's stdout to the
receiver's stdin, and nudges a process through stdin where it must wait.

Scenarios:

* ``forward``: the orchestrator's ``try_send_via_connector`` (stage 0 -> 1)
  and the stage worker's ``try_recv_via_connector``.
* ``chunks``: two ``OmniChunkTransferAdapter`` instances (stage 0 sender,
  stage 1 receiver), chunk keys ``{req}_0_{k}`` polled without metadata.
* ``ranks``: KV keys from ``build_rank_aware_send_keys`` for TP 2 -> 2 and
  1 -> 2, read by one thread per receiver rank; then unread keys of another
  request freed by the receiver's ``cleanup``.
* ``latency``: payloads of each of ``--sizes`` bytes, one at a time, through the
  connector named by ``--connector`` (RelaydConnector or vllm-omni's
  SharedMemoryConnector); the receiver polls every 0.1 ms and reports the
  median time from the sender's put to its get returning.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import warnings
from types import SimpleNamespace
from typing import Any

import torch
from vllm_omni.distributed.omni_connectors.adapter import (
    try_recv_via_connector,
    try_send_via_connector,
)
from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import (
    OmniChunkTransferAdapter,
)
from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec
from vllm_omni.distributed.omni_connectors.utils.initialization import (
    build_stage_connectors,
    get_stage_connector_config,
    initialize_orchestrator_connectors,
    load_omni_transfer_config,
)
from vllm_omni.distributed.omni_connectors.utils.kv_utils import (
    KVTPTopology,
    build_rank_aware_recv_keys,
    build_rank_aware_send_keys,
)
from vllm_omni.plugins import load_omni_general_plugins

from tests._workers import digest
from tests.frameworks._procs import REPORT

WAIT_S = 60.0
CHUNKS = 8
CHUNK_ELEMS = 24 * 1024  # 96 KiB of float32 per chunk


def emit(**kw: Any) -> None:
    print(REPORT, json.dumps(kw), flush=True)


def stdin_lines() -> Any:
    for line in sys.stdin:
        if line.strip():
            yield json.loads(line)


def poll(fn: Any, what: str, interval: float = 0.001) -> Any:
    deadline = time.monotonic() + WAIT_S
    while (value := fn()) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not arrive within {WAIT_S}s")
        time.sleep(interval)
    return value


def stage_inputs(seed: int, nbytes: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "prompt_token_ids": list(range(seed, seed + 32)),
        "hidden": torch.randn(nbytes // 4, generator=g),
        "mm": {"image_embeds": torch.randn(4, 64, generator=g).to(torch.bfloat16)},
        "flags": (True, None, 1.5),
    }


class Metrics:
    """The orchestrator's on_forward, recorded."""

    def __init__(self) -> None:
        self.forwarded: list[tuple[int, int, str, int]] = []

    def on_forward(self, src: int, dst: int, rid: str, size: int, tx_ms: float, used: bool) -> None:
        self.forwarded.append((src, dst, rid, size))


# -- forward: the orchestrator and a stage worker -----------------------------------------


def forward_sender(a: argparse.Namespace) -> None:
    from vllm.sampling_params import SamplingParams

    _cfg, connectors = initialize_orchestrator_connectors(a.config)
    conn = connectors[("0", "1")]
    metrics = Metrics()
    sent = {}
    for rid, nbytes in (("req-small", 64 * 1024), ("req-big", 4 << 20)):
        inputs = stage_inputs(len(rid), nbytes)

        def submit(p: dict[str, Any]) -> None:
            keep = ("type", "request_id", "from_connector", "from_stage", "to_stage")
            emit(notify={k: p[k] for k in keep}, metadata=p.get("connector_metadata"))

        ok = try_send_via_connector(
            connector=conn,
            stage_id=0,
            next_stage_id=1,
            req_id=rid,
            next_inputs=inputs,
            sampling_params=SamplingParams(temperature=0.7, max_tokens=16),
            original_prompt={"prompt": "hello", "mm_hashes": ["x"]},
            next_stage_queue_submit_fn=submit,
            metrics=metrics,
        )
        sent[rid] = digest(inputs) if ok else None
    emit(connector=type(conn).__name__, sent=sent, forwarded=[f[3] for f in metrics.forwarded])
    for _ in stdin_lines():  # the receiver is done
        break
    conn.close()


def forward_receiver(a: argparse.Namespace) -> None:
    cfg = get_stage_connector_config(load_omni_transfer_config(a.config), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        connectors = build_stage_connectors(1, cfg)
    conn = connectors[("0", "1")]
    emit(connector=type(conn).__name__, stage_id=conn.stage_id)
    for task in stdin_lines():
        inputs, rx = try_recv_via_connector(task, connectors, stage_id=1)
        emit(got={task["request_id"]: digest(inputs)}, rx_bytes=rx["rx_transfer_bytes"])
    conn.close()


# -- chunks: the chunk transfer adapter on both ends -------------------------------------


def chunk_payload(
    transfer_manager: OmniChunkTransferAdapter,
    multimodal_output: Any,
    request: Any,
    is_finished: bool,
) -> Any:
    """The stage's chunk processor (vllm-omni resolves it by dotted path)."""
    from vllm_omni.data_entry_keys import CodesStruct, HiddenStatesStruct, OmniPayloadStruct

    k = transfer_manager.put_req_chunk[request.external_req_id]
    g = torch.Generator().manual_seed(500 + k)
    return OmniPayloadStruct(
        hidden_states=HiddenStatesStruct(output=torch.randn(CHUNK_ELEMS, generator=g)),
        codes=CodesStruct(audio=torch.arange(k, k + 4)),
    )


def expected_chunk(k: int) -> str:
    g = torch.Generator().manual_seed(500 + k)
    return digest(torch.randn(CHUNK_ELEMS, generator=g))


def chunk_adapter(a: argparse.Namespace, stage_id: int) -> OmniChunkTransferAdapter:
    spec = load_omni_transfer_config(a.config).connectors[("0", "1")]
    model_config = SimpleNamespace(
        stage_id=stage_id,
        stage_connector_config={"name": spec.name, "extra": dict(spec.extra)},
        worker_type="generation",
        async_chunk=True,
        max_model_len=0,
        custom_process_next_stage_input_func="tests.frameworks._vllm_stage.chunk_payload",
    )
    return OmniChunkTransferAdapter(
        SimpleNamespace(model_config=model_config, scheduler_config=SimpleNamespace(max_num_seqs=4))
    )


def chunk_request(rid: str) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=f"int-{rid}",
        external_req_id=rid,
        status=None,
        prompt_token_ids=[],
        num_computed_tokens=0,
        num_output_placeholders=0,
        additional_information=None,
        resumable=False,
        is_finished=lambda: False,
    )


def chunks_sender(a: argparse.Namespace) -> None:
    adapter = chunk_adapter(a, 0)
    req = chunk_request("stream-1")
    for k in range(CHUNKS):
        adapter.save_async(
            multimodal_output=None,
            request=req,
            confirmed_num_computed_tokens=k + 1,
            force_request_finished=k == CHUNKS - 1,
        )
    poll(lambda: adapter.connector.health()["puts"] == CHUNKS or None, "the chunk puts")
    emit(connector=type(adapter.connector).__name__, sent=CHUNKS)
    for _ in stdin_lines():
        break
    adapter.shutdown()


def chunks_receiver(a: argparse.Namespace) -> None:
    adapter = chunk_adapter(a, 1)
    req = chunk_request("stream-1")
    got, codes = [], []
    for k in range(CHUNKS):
        adapter.load_async(req)
        # What the scheduler waits for: the adapter marks the request loaded
        # once the chunk is committed into it.
        poll(lambda: req.request_id in adapter._finished_load_reqs or None, f"chunk {k}")
        adapter._finished_load_reqs.discard(req.request_id)
        assert adapter.get_req_chunk[req.request_id] == k + 1
        info = req.additional_information
        got.append(digest(info["hidden_states"]["output"]))
        codes.append(list(req.prompt_token_ids))
    emit(
        got=got,
        expected=[expected_chunk(k) for k in range(CHUNKS)],
        codes=codes,
        done=adapter.is_done_receiving_chunks(req.request_id),
    )
    adapter.shutdown()


# -- ranks: TP rank keys, then cleanup ----------------------------------------------------


def rank_payload(key: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(sum(key.encode()))
    return {"key": key, "kv": torch.randn(64 * 1024, generator=g), "blocks": [1, 2, 3]}


def make_connector(a: argparse.Namespace, stage_id: int) -> Any:
    spec = load_omni_transfer_config(a.config).connectors[("0", "1")]
    return OmniConnectorFactory.create_connector(
        ConnectorSpec(name=spec.name, extra={**spec.extra, "stage_id": stage_id})
    )


TOPOLOGIES = {"tp2to2": (2, 2), "tp1to2": (1, 2)}


def ranks_sender(a: argparse.Namespace) -> None:
    conn = make_connector(a, 0)
    sent = {}
    for name, (src, dst) in TOPOLOGIES.items():
        for rank in range(src):
            for key in build_rank_aware_send_keys(name, "0", "1", KVTPTopology(src, dst, rank)):
                ok, _size, _meta = conn.put("0", "1", key, rank_payload(key))
                sent[key] = digest(rank_payload(key)) if ok else None
    for k in range(3):  # a request the receiver will drop unread
        big = {"h": torch.zeros(256 * 1024)}
        assert conn.put("0", "1", f"gone_0_{k}", big)[0]
        assert conn.put("0", "1", f"gone_0_{k}_0_{k % 2}", big)[0]
    emit(sent=sent)
    for _ in stdin_lines():
        break
    conn.close()


def ranks_receiver(a: argparse.Namespace) -> None:
    conn = make_connector(a, 1)
    got: dict[str, str] = {}
    lock = threading.Lock()

    def rank_reader(name: str, src: int, dst: int, rank: int) -> None:
        for key, _from_rank in build_rank_aware_recv_keys(
            name, "0", "1", KVTPTopology(src, dst, rank)
        ):
            obj, _size = poll(lambda key=key: conn.get("0", "1", key), key)
            with lock:
                got[key] = digest(obj)

    threads = [
        threading.Thread(target=rank_reader, args=(name, src, dst, rank))
        for name, (src, dst) in TOPOLOGIES.items()
        for rank in range(dst)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    again = conn.get("0", "1", next(iter(got)))  # consumed: not there any more
    emit(got=got, again=again)
    for _ in stdin_lines():  # the sender has put the request to drop
        break
    conn.cleanup("gone")
    after = [conn.get("0", "1", f"gone_0_{k}") for k in range(3)]
    emit(cleaned=True, after=after, health=conn.health())
    for _ in stdin_lines():
        break
    conn.close()
    conn.close()  # twice: vllm-omni calls it again from __del__


# -- latency ---------------------------------------------------------------------------


def latency_connector(a: argparse.Namespace, stage_id: int) -> Any:
    if a.connector == "shm":
        from vllm_omni.distributed.omni_connectors.connectors.shm_connector import (
            SharedMemoryConnector,
        )

        return SharedMemoryConnector({"stage_id": stage_id})
    return make_connector(a, stage_id)


def latency_sender(a: argparse.Namespace) -> None:
    conn = latency_connector(a, 0)
    for size in a.sizes:
        for i in range(a.rounds):
            data = {"x": torch.randint(0, 255, (size,), dtype=torch.uint8), "t0": time.monotonic()}
            assert conn.put("0", "1", f"lat{size}_{i}", data)[0]
            poll(lambda i=i, s=size: conn.get("1", "0", f"ack{s}_{i}"), "the ack", 0.0001)
    emit(sent=a.rounds)
    conn.close()


def latency_receiver(a: argparse.Namespace) -> None:
    conn = latency_connector(a, 1)
    medians = {}
    for size in a.sizes:
        times = []
        for i in range(a.rounds):
            key = f"lat{size}_{i}"
            obj, _size = poll(lambda key=key: conn.get("0", "1", key), "a payload", 0.0001)
            times.append(time.monotonic() - obj["t0"])
            assert obj["x"].numel() == size
            assert conn.put("1", "0", f"ack{size}_{i}", {"ok": 1})[0]
        warm = times[len(times) // 5 :]  # the first rounds open sessions, map memory
        medians[str(size)] = statistics.median(warm)
    emit(median_s=medians)
    conn.close()


ROLES = {
    ("sender", "forward"): forward_sender,
    ("receiver", "forward"): forward_receiver,
    ("sender", "chunks"): chunks_sender,
    ("receiver", "chunks"): chunks_receiver,
    ("sender", "ranks"): ranks_sender,
    ("receiver", "ranks"): ranks_receiver,
    ("sender", "latency"): latency_sender,
    ("receiver", "latency"): latency_receiver,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["sender", "receiver"])
    ap.add_argument("--config", required=True)
    ap.add_argument("--scenario", choices=sorted({s for _, s in ROLES}), required=True)
    ap.add_argument("--connector", choices=["relayd", "shm"], default="relayd")
    ap.add_argument("--sizes", type=int, nargs="+", default=[256 * 1024, 4 << 20])
    ap.add_argument("--rounds", type=int, default=50)
    a = ap.parse_args()
    load_omni_general_plugins()  # the client's entry point registers RelaydConnector
    ROLES[(a.role, a.scenario)](a)


if __name__ == "__main__":
    main()
