# Sourced by the setup scripts: the pip options that install the CPU build of
# torch (constraints/cpu.txt) and where pip may find it.
#
# TORCH_CPU_INDEX (default PyTorch's CPU wheel index) is added as an extra
# index when it answers. When it does not (an offline or mirrored machine) it
# is left out and pip uses only its own configured sources, which must then
# offer torch==<version>+cpu (a find-links directory or a mirror); otherwise
# pip stops with "No matching distribution", never with a CUDA build.
# TORCH_CPU_INDEX= (empty) never adds it. An unreachable index is not simply
# passed to pip: pip retries it with back-off for every package it resolves.
TORCH_CPU_INDEX=${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}
PIP_CPU_ARGS=(-c constraints/cpu.txt)
if [ -n "$TORCH_CPU_INDEX" ]; then
  if python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/torch/", timeout=10)' \
      "$TORCH_CPU_INDEX" 2>/dev/null; then
    PIP_CPU_ARGS+=(--extra-index-url "$TORCH_CPU_INDEX")
  else
    echo "note: $TORCH_CPU_INDEX is unreachable; torch's CPU build must come from pip's own sources" >&2
  fi
fi
