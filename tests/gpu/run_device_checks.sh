#!/usr/bin/env bash
# relayd GPU device checks: offline install, IPC smoke test, GPU tests, GPU benchmark.
#
#   bash tests/gpu/run_device_checks.sh [RESULTS_DIR]
#
# RESULTS_DIR defaults to $OUT when set, else ./gpu-results. Written there:
# summary.md (read this first; written whatever happens), install.txt,
# ipc-smoke.{md,json,log}, env.txt, gpu-tests.log, gpu-tests.xml,
# gpu-bench.txt, gpu-bench.json, logs/ (the test daemon's log).
#
# Steps, in this order, each under its own timeout against one deadline
# (the whole run ends within 6 minutes):
#
# 1. install: the wheels of scripts/gpu-wheels.sh (GPU_WHEELS, default
#    ./gpu-wheels) go offline (pip --no-index --no-deps) into a private
#    target directory (GPU_SITE, default ./.gpu-site), put first on
#    PYTHONPATH; the versions in effect afterwards are printed. No wheels:
#    the machine's own packages are used, and the summary says so.
# 2. smoke: a two-process test of the raw CUDA calls (IPC memory handle,
#    interprocess event, cudaHostRegister on /dev/shm), each reported works
#    or fails. No CUDA device: reported, nothing after this runs (exit 2).
# 3. env: every runtime dependency imports, and so does this tree's code.
# 4. tests: pytest -m gpu tests/gpu.
# 5. benchmark: relayd bench --gpu --quick.
#
# relayd and relayd_client run from this tree through PYTHONPATH, installed
# or not. PYTHON=/path/to/python picks the interpreter (default: the first
# of python3, python that imports torch).
#
# Exit: 0 all passed; 1 a test or the benchmark failed (or timed out);
# 2 no CUDA device (GPU tests skipped, nothing measured); 3 a dependency is
# missing (nothing run).
set -u -o pipefail

START=$SECONDS
DEADLINE=$((START + 345)) # 15 s spare under 6 minutes
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RESULTS="${1:-${OUT:-./gpu-results}}"
mkdir -p "$RESULTS/logs"
RESULTS="$(cd "$RESULTS" && pwd)"
cd "$ROOT" || exit 3
WHEELS="${GPU_WHEELS:-$ROOT/gpu-wheels}"
SITE="${GPU_SITE:-$ROOT/.gpu-site}"
export PYTHONPATH="$SITE:$ROOT/client:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export RELAYD_GPU_LOGDIR="$RESULTS/logs"
export PYTHONUNBUFFERED=1
SUMMARY="$RESULTS/summary.md"

left() { echo $((DEADLINE - SECONDS)); }
# bounded SECONDS CMD...: CMD under a timeout of at most SECONDS, never past the deadline.
bounded() {
  local limit=$1
  shift
  local rest
  rest=$(left)
  ((rest < limit)) && limit=$rest
  if ((limit < 5)); then
    echo "skipped: no time left before the 6-minute deadline" >&2
    return 124
  fi
  if command -v timeout >/dev/null 2>&1; then
    timeout -k 10 "$limit" "$@"
  else
    "$@"
  fi
}
note() { printf '%s\n' "$@" >>"$SUMMARY"; }

{
  echo "# relayd GPU device checks"
  echo
  if commit=$(git rev-parse --short HEAD 2>/dev/null); then
    git diff --quiet HEAD 2>/dev/null || commit="$commit (+ local changes)"
  else
    commit="unknown (not a git checkout)"
  fi
  echo "- commit: $commit"
  echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "- gpus: $( (bounded 15 nvidia-smi -L 2>/dev/null || echo 'nvidia-smi not found or failed') | tr '\n' ';')"
  echo "- /dev/shm: $(df -h /dev/shm 2>/dev/null | awk 'NR==2 {print $4 " free of " $2}' || echo unknown)"
  echo "- memlock: soft $(ulimit -S -l) hard $(ulimit -H -l)"
} >"$SUMMARY"
# Page-locking the arena needs RLIMIT_MEMLOCK to cover it (preflight checks);
# the tests fall back to --pin-host-memory off where it cannot be raised.
ulimit -S -l "$(ulimit -H -l)" 2>/dev/null || true

# The interpreter: $PYTHON, else the first of python3, python that has torch.
PY=""
for cand in ${PYTHON:-} python3 python; do
  if command -v "$cand" >/dev/null 2>&1 && bounded 60 "$cand" -c "import torch" >/dev/null 2>&1; then
    PY="$(command -v "$cand")"
    break
  fi
done
if [ -z "$PY" ]; then
  note "" "**not run**: no Python interpreter that imports torch (tried: ${PYTHON:+$PYTHON }python3 python); set PYTHON=..."
  echo "no Python interpreter with torch found; see $SUMMARY" >&2
  exit 3
fi

# -- 1. install the carried wheels offline, before anything imports them -------
rm -rf "$SITE"
mkdir -p "$SITE"
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
shopt -u nullglob
{
  if [ "${#wheels[@]}" -eq 0 ]; then
    echo "no wheels in $WHEELS (run scripts/gpu-wheels.sh where there is network): using the machine's packages"
  else
    echo "installing ${#wheels[@]} wheels offline from $WHEELS into $SITE"
    # One wheel at a time: a wheel for another Python (the machine's is not
    # 3.12?) is reported and skipped, the others still go in.
    failed=0
    have_pip=1
    "$PY" -m pip --version >/dev/null 2>&1 || have_pip=0
    for w in "${wheels[@]}"; do
      if [ "$have_pip" -eq 0 ]; then
        # No pip in this interpreter: a wheel is a zip laid out for site-packages.
        "$PY" -m zipfile -e "$w" "$SITE" && echo "unpacked (no pip) $(basename "$w")" ||
          { failed=$((failed + 1)) && echo "FAILED to unpack $(basename "$w")"; }
      # --no-deps: the folder holds the dependencies too; nothing may come from an index.
      elif out=$(bounded 60 "$PY" -m pip install --no-index --no-deps --find-links "$WHEELS" \
        --target "$SITE" --upgrade --quiet "$w" 2>&1); then
        echo "installed $(basename "$w")"
      else
        failed=$((failed + 1))
        echo "FAILED $(basename "$w"): $(printf '%s' "$out" | grep -m1 -E 'ERROR|error' || printf '%s' "$out" | tail -1)"
      fi
    done
    if [ "$failed" -eq 0 ]; then
      echo "offline install: ok"
    else
      echo "offline install: $failed of ${#wheels[@]} wheels FAILED: the machine's own packages stand in for them"
    fi
  fi
  bounded 60 "$PY" - <<'EOF'
import importlib, importlib.metadata as md, os
for dist, mod in (("grpcio", "grpc"), ("grpcio-health-checking", "grpc_health"),
                  ("protobuf", "google.protobuf"), ("prometheus-client", "prometheus_client"),
                  ("uvloop", "uvloop"), ("typing-extensions", "typing_extensions"),
                  ("numpy", "numpy"), ("pytest", "pytest"), ("torch", "torch")):
    try:
        m = importlib.import_module(mod)
        where = os.path.dirname(getattr(m, "__file__", None) or "?")
        try:
            version = getattr(m, "__version__", None) or md.version(dist)
        except md.PackageNotFoundError:
            version = "?"
        print(f"version {dist} {version} from {where}")
    except Exception as exc:
        print(f"version {dist} ABSENT ({type(exc).__name__}: {exc})")
EOF
} 2>&1 | tee "$RESULTS/install.txt"
note "" "## install" ""
while IFS= read -r line; do note "- $line"; done <"$RESULTS/install.txt"

# -- 2. two-process smoke test of the raw CUDA calls -----------------------------
bounded 120 "$PY" -m tests.gpu._ipc_smoke --timeout 60 \
  --json "$RESULTS/ipc-smoke.json" --md "$RESULTS/ipc-smoke.md" >"$RESULTS/ipc-smoke.log" 2>&1
SMOKE_RC=$?
cat "$RESULTS/ipc-smoke.log"
note ""
if [ -s "$RESULTS/ipc-smoke.md" ]; then
  cat "$RESULTS/ipc-smoke.md" >>"$SUMMARY"
else
  note "## CUDA IPC smoke test" "" "**the smoke test itself failed (exit $SMOKE_RC)**:" '```'
  tail -15 "$RESULTS/ipc-smoke.log" >>"$SUMMARY"
  note '```'
fi
if [ "$SMOKE_RC" -eq 2 ]; then
  note "" "**NO CUDA DEVICE**: GPU tests and benchmark not run." "" "elapsed: $((SECONDS - START)) s"
  echo "no CUDA device; summary: $SUMMARY"
  exit 2
fi

# -- 3. environment --------------------------------------------------------------
# Fail clearly, before anything runs, when a dependency is missing.
bounded 60 "$PY" - >"$RESULTS/env.txt" 2>&1 <<'EOF'
import importlib, importlib.util, sys
need = {"torch": "torch", "grpc": "grpcio", "grpc_health": "grpcio-health-checking",
        "google.protobuf": "protobuf", "prometheus_client": "prometheus-client"}
def absent(mod):
    try:
        return importlib.util.find_spec(mod) is None
    except ImportError:  # a missing parent package ("google")
        return True
print(f"python {sys.executable} {sys.version.split()[0]}")
missing = [pkg for mod, pkg in need.items() if absent(mod)]
if missing:
    print("MISSING Python packages: " + ", ".join(missing) + " (carry them: scripts/gpu-wheels.sh)")
    sys.exit(3)
# The repository's own code must import with the installed versions
# (generated protobuf/grpc code checks the runtime's version).
for mod in ("relayd_client", "relayd.server", "relayd_bench.gpu"):
    try:
        importlib.import_module(mod)
    except Exception as exc:
        print(f"MISSING: {mod} does not import: {type(exc).__name__}: {exc}")
        sys.exit(3)
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{torch.cuda.device_count()} device(s), available={torch.cuda.is_available()}")
for m in ("pytest", "pytest_timeout", "uvloop"):
    print(f"{m}: {'yes' if not absent(m) else 'no'}")
if not torch.cuda.is_available():
    print("NO CUDA: torch sees no CUDA device")
    sys.exit(2)
EOF
ENV_RC=$?
cat "$RESULTS/env.txt"
note "" "## environment" ""
while IFS= read -r line; do note "- $line"; done <"$RESULTS/env.txt"
if [ "$ENV_RC" -ne 0 ] && [ "$ENV_RC" -ne 2 ]; then
  note "" "**not run**: $(grep -m1 MISSING "$RESULTS/env.txt" || echo "environment check failed (exit $ENV_RC)")"
  echo "summary: $SUMMARY"
  exit 3
fi
NO_CUDA=0
[ "$ENV_RC" -eq 2 ] && NO_CUDA=1

# -- 4. tests -------------------------------------------------------------------
TESTS_RC=3 TESTS_RAN=0
if grep -q "^pytest: yes" "$RESULTS/env.txt"; then
  # pytest-timeout is optional: without it the ini's `timeout` key is unknown,
  # so run with the strict options minus --strict-config.
  PYTEST_ARGS=(-m gpu tests/gpu -v -rs -p no:cacheprovider --junitxml="$RESULTS/gpu-tests.xml")
  if grep -q "^pytest_timeout: yes" "$RESULTS/env.txt"; then
    PYTEST_ARGS+=(--timeout=90)
  else
    PYTEST_ARGS+=(-o "addopts=-ra --strict-markers" -W "ignore::pytest.PytestConfigWarning")
  fi
  # Leave ~85 s for the benchmark.
  bounded $(($(left) - 85)) "$PY" -m pytest "${PYTEST_ARGS[@]}" 2>&1 | tee "$RESULTS/gpu-tests.log"
  TESTS_RC=${PIPESTATUS[0]}
  TESTS_RAN=1
else
  echo "MISSING: pytest is not installed: GPU tests not run" | tee "$RESULTS/gpu-tests.log"
fi

# -- 5. benchmark ---------------------------------------------------------------
bounded 80 "$PY" -m relayd_bench --gpu --quick --json "$RESULTS/gpu-bench.json" 2>&1 |
  tee "$RESULTS/gpu-bench.txt"
BENCH_RC=${PIPESTATUS[0]}

timed() { [ "$1" -eq 124 ] || [ "$1" -eq 137 ] && echo ", TIMED OUT"; }
{
  echo
  if [ "$NO_CUDA" -eq 1 ]; then
    echo "**NO CUDA DEVICE**: GPU tests skipped, nothing measured."
    echo
  elif grep -q " 1 device(s)" "$RESULTS/env.txt"; then
    echo "**one GPU**: the cross-GPU pool path (with and without peer access) was not exercised."
    echo
  fi
  echo "## tests (exit $TESTS_RC$(timed "$TESTS_RC")$([ "$TESTS_RAN" -eq 0 ] && echo ', NOT RUN'))"
  echo
  echo '```'
  grep -E "(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)( |$)|^(FAILED|ERROR) |[0-9]+ (passed|failed|skipped|error)" \
    "$RESULTS/gpu-tests.log" | tail -30
  echo '```'
  echo
  echo "### figures"
  echo
  echo '```'
  sed -n '/relayd fault and adversarial figures/,$p' "$RESULTS/gpu-tests.log" | grep -E "^[a-z].*: " | head -20
  echo '```'
  echo
  echo "## benchmark (exit $BENCH_RC$(timed "$BENCH_RC"))"
  echo
  echo '```'
  tail -60 "$RESULTS/gpu-bench.txt"
  echo '```'
  echo
  echo "elapsed: $((SECONDS - START)) s"
} >>"$SUMMARY"

echo "summary: $SUMMARY"
if [ "$NO_CUDA" -eq 1 ]; then
  exit 2
elif [ "$TESTS_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]; then
  exit 0
elif [ "$TESTS_RAN" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]; then
  exit 3 # benchmark ran, tests could not (pytest missing)
fi
exit 1
