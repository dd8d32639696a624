"""One-way latency through each framework integration, next to the framework's
own shared-memory backend, from one run.

    .venv-frameworks/bin/python scripts/bench_integrations.py [--rounds 50]

For each framework, two processes move one payload at a time (the sender
waits for the receiver's go-ahead before the next): sglang-omni's CommEngine
with ``RelaydRelay`` and with its ``shm`` relay, vllm-omni's connector API with
``RelaydConnector`` and with its ``SharedMemoryConnector`` (receiver polling
every 0.1 ms). The time is from the sender starting its send to the receiver
holding the data, read from CLOCK_MONOTONIC in both processes; the median of
the rounds after the first fifth. The workers are the framework tests' own
(tests/frameworks/_sglang_stage.py, _vllm_stage.py). Each runs one intra-op
thread (OMP_NUM_THREADS=1): on a small machine two processes' OpenMP pools
spinning against each other added ~18 ms to every sglang-omni transfer of
256 KiB and up, whatever the relay.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests._daemon import running_daemon
from tests.frameworks._procs import Worker

SIZES = (256 * 1024, 4 << 20)


def sglang(tmp: str, socket: str, relay: str, rounds: int) -> dict[str, float]:
    ep = {s: f"ipc://{tmp}/{relay}-{s}.ipc" for s in ("thinker", "talker")}

    def start(role: str, peer: str) -> Worker:
        args = [role, "--socket", socket, "--me", ep[role], "--peer", ep[peer]]
        args += ["--scenario", "latency", "--relay", relay, "--rounds", str(rounds)]
        args += ["--sizes", *map(str, SIZES)]
        return Worker("tests.frameworks._sglang_stage", args, f"{tmp}/sg-{relay}-{role}.log")

    talker, thinker = start("talker", "thinker"), start("thinker", "talker")
    medians: dict[str, float] = talker.expect("median_s", timeout=600)
    thinker.expect("settled", timeout=120)
    talker.finish()
    thinker.finish()
    return medians


def vllm(tmp: str, socket: str, connector: str, rounds: int) -> dict[str, float]:
    config = f"{tmp}/omni.yaml"
    with open(config, "w") as f:
        f.write(
            "runtime:\n  connectors:\n    relayd:\n      name: RelaydConnector\n"
            f"      extra: {{socket: {socket}, stage: bench}}\n"
            "stage_args:\n  - stage_id: 0\n    output_connectors: {to_stage_1: relayd}\n"
            "  - stage_id: 1\n    input_connectors: {from_stage_0: relayd}\n"
        )

    def start(role: str) -> Worker:
        args = [role, "--config", config, "--scenario", "latency", "--connector", connector]
        args += ["--rounds", str(rounds), "--sizes", *map(str, SIZES)]
        return Worker("tests.frameworks._vllm_stage", args, f"{tmp}/vl-{connector}-{role}.log")

    receiver, sender = start("receiver"), start("sender")
    medians: dict[str, float] = receiver.expect("median_s", timeout=600)
    sender.expect("sent", timeout=120)
    receiver.finish()
    sender.finish()
    return medians


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=50)
    a = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the workers
    with (
        tempfile.TemporaryDirectory(prefix="relayd-bench-") as tmp,
        running_daemon(tmp, pool="256MiB") as d,
    ):
        rows = [
            ("sglang-omni", "RelaydRelay", sglang(tmp, d.socket, "relayd", a.rounds)),
            ("sglang-omni", "shm relay", sglang(tmp, d.socket, "shm", a.rounds)),
            ("vllm-omni", "RelaydConnector", vllm(tmp, d.socket, "relayd", a.rounds)),
            ("vllm-omni", "SharedMemoryConnector", vllm(tmp, d.socket, "shm", a.rounds)),
        ]
    print(f"one-way latency, median of {a.rounds - a.rounds // 5} rounds (ms)")
    print("| framework | backend | " + " | ".join(f"{s // 1024} KiB" for s in SIZES) + " |")
    print("|---|---|" + "---|" * len(SIZES))
    for framework, backend, medians in rows:
        cells = " | ".join(f"{medians[str(s)] * 1e3:.3f}" for s in SIZES)
        print(f"| {framework} | {backend} | {cells} |")


if __name__ == "__main__":
    main()
