"""``relayd bench --gpu``: the hook GPU benchmarks plug into.

A stub until the CUDA paths (cuda_ipc_direct, cuda_ipc_pool) exist: it reports
what it found and measures nothing. Replace ``run`` with the real benchmark; it
receives the parsed command line and returns the process exit status.
"""

from __future__ import annotations

import argparse
import sys


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("relayd bench --gpu: no CUDA device visible; nothing measured", file=sys.stderr)
        return 2
    print(
        f"relayd bench --gpu: {torch.cuda.device_count()} CUDA device(s) visible, but the GPU"
        " benchmarks are not written yet; nothing measured",
        file=sys.stderr,
    )
    return 2
