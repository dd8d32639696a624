#!/usr/bin/env bash
# Set up a virtual environment and run everything CI runs: lint, types, the
# whole test suite (unit, integration, faults, adversarial, multinode with a
# real Mooncake engine, deploy checks) and a quick benchmark smoke run; then,
# in a second environment, the sglang-omni and vllm-omni integration tests.
set -euo pipefail
cd "$(dirname "$0")/.."

# Mooncake's wheel links libibverbs/libnuma/libcurl, and tests/deploy checks the
# firewall recipe with nft; CI runs as root on a bare machine.
missing=()
ldconfig -p | grep -q 'libibverbs.so.1' || missing+=(libibverbs1 libnuma1 libcurl4)
command -v nft >/dev/null || [ -x /usr/sbin/nft ] || missing+=(nftables)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "note: ${missing[*]} missing and not root; multinode and nftables tests will be skipped" >&2
  fi
fi

python3 -m venv .venv
. .venv/bin/activate
# constraints/cpu.txt pins the CPU build of torch on machines without a GPU
# (scripts/_pip_cpu.sh says where pip finds it); GPU nodes run the same line
# without "${PIP_CPU_ARGS[@]}" and keep their own torch.
. scripts/_pip_cpu.sh
pip install -q --disable-pip-version-check "${PIP_CPU_ARGS[@]}" -e ./client -e '.[test,mooncake,bench]'

# The project's own modules, compiled once: the suite starts hundreds of daemons
# and workers, and where PYTHONDONTWRITEBYTECODE is set (container images often
# set it) each of them compiled relayd again, ~0.3 s apiece (tests/integration:
# 17% less CPU, 13% less time). __pycache__ is ignored by git; a changed source
# is compiled again as it is imported.
python -m compileall -q -j 0 relayd relayd_bench client/relayd_client tests >/dev/null

python scripts/gen_protos.py --check
ruff check .
ruff format --check .
mypy
# Two pytest workers (pytest-xdist): most tests wait on daemons, peers and
# timeouts rather than compute, so two halve the suite's time on CI's two cores
# (25 -> 14 minutes). More would share /dev/shm arenas and cores thinner than the
# tests' deadlines were sized for. RELAYD_TEST_WORKERS=0 runs in this process.
python -m pytest -n "${RELAYD_TEST_WORKERS:-2}" "$@"

# The framework integrations against sglang-omni's and vllm-omni's released
# code, in their own environment (CI runs this script without arguments).
if [ $# -eq 0 ]; then
  deactivate
  ./scripts/frameworks-env.sh
  RELAYD_TEST_FRAMEWORKS=1 .venv-frameworks/bin/python -m pytest tests/frameworks
fi
