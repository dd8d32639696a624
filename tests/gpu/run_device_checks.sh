#!/usr/bin/env bash
# relayd GPU device checks: the GPU test suite, then the GPU benchmark.
#
#   tests/gpu/run_device_checks.sh [RESULTS_DIR]
#
# RESULTS_DIR defaults to $OUT when set, else ./gpu-results. Written there:
# summary.md (read this first), gpu-tests.log, gpu-tests.xml, gpu-bench.txt,
# gpu-bench.json, daemon logs of failed tests are in gpu-tests.log.
#
# Installs nothing from the network. It expects, already installed: torch
# with CUDA, grpcio, grpcio-health-checking, protobuf, prometheus-client and
# pytest (pytest-timeout and uvloop are optional). relayd and relayd_client
# run from this tree through PYTHONPATH; `pip install --no-deps
# --no-build-isolation -e ./client -e .` works too. Budget: under 5 minutes
# on one GPU (tests ~2 min, benchmark ~1 min).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RESULTS="${1:-${OUT:-./gpu-results}}"
mkdir -p "$RESULTS"
RESULTS="$(cd "$RESULTS" && pwd)"
PY="${PYTHON:-$(command -v python || command -v python3)}"
cd "$ROOT"
export PYTHONPATH="$ROOT/client:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY="$RESULTS/summary.md"
# Page-locking the arena needs RLIMIT_MEMLOCK to cover it (preflight checks);
# the tests fall back to --pin-host-memory off where it cannot be raised.
ulimit -l unlimited 2>/dev/null || true

{
  echo "# relayd GPU device checks"
  echo
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "- gpus: $(nvidia-smi -L 2>/dev/null | tr '\n' ';' || echo 'nvidia-smi not found')"
} >"$SUMMARY"

# Fail clearly, before anything runs, when a dependency is missing.
if ! "$PY" - >"$RESULTS/deps.txt" 2>&1 <<'EOF'; then
import importlib.util, sys
need = {"torch": "torch", "grpc": "grpcio", "grpc_health": "grpcio-health-checking",
        "google.protobuf": "protobuf", "prometheus_client": "prometheus-client",
        "pytest": "pytest"}
def absent(mod):
    try:
        return importlib.util.find_spec(mod) is None
    except ImportError:  # a missing parent package ("google")
        return True
missing = [pkg for mod, pkg in need.items() if absent(mod)]
if missing:
    print("missing Python packages: " + ", ".join(missing) + " (this script installs nothing)")
    sys.exit(1)
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{torch.cuda.device_count()} device(s), available={torch.cuda.is_available()}")
if not torch.cuda.is_available():
    print("torch sees no CUDA device")
    sys.exit(1)
EOF
  cat "$RESULTS/deps.txt"
  { echo; echo "**not run**: $(tail -1 "$RESULTS/deps.txt")"; } >>"$SUMMARY"
  exit 3
fi
echo "- $(cat "$RESULTS/deps.txt")" >>"$SUMMARY"

# pytest-timeout is optional here: without it the ini's `timeout` key is
# unknown, so run with the strict options minus --strict-config.
PYTEST_ARGS=(-m gpu tests/gpu -v -rs -p no:cacheprovider --junitxml="$RESULTS/gpu-tests.xml")
if ! "$PY" -c "import pytest_timeout" 2>/dev/null; then
  PYTEST_ARGS+=(-o "addopts=-ra --strict-markers" -W "ignore::pytest.PytestConfigWarning")
fi
timeout 200 "$PY" -m pytest "${PYTEST_ARGS[@]}" 2>&1 | tee "$RESULTS/gpu-tests.log"
TESTS_RC=${PIPESTATUS[0]}

timeout 90 "$PY" -m relayd.bench --gpu --quick --json "$RESULTS/gpu-bench.json" 2>&1 \
  | tee "$RESULTS/gpu-bench.txt"
BENCH_RC=${PIPESTATUS[0]}

{
  echo
  echo "## tests (exit $TESTS_RC)"
  echo
  echo '```'
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$RESULTS/gpu-tests.log" | tail -20
  echo '```'
  echo
  echo "## benchmark (exit $BENCH_RC)"
  echo
  echo '```'
  cat "$RESULTS/gpu-bench.txt"
  echo '```'
} >>"$SUMMARY"

echo "summary: $SUMMARY"
[ "$TESTS_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
