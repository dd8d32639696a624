#!/usr/bin/env bash
# Set up a virtual environment, start relayd on the embedded default and run
# the thinker -> talker demo pipeline through it.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
# The CPU build of torch (constraints/cpu.txt; scripts/_pip_cpu.sh says where
# pip finds it); on a GPU node install by hand without it.
. scripts/_pip_cpu.sh
pip install -q --disable-pip-version-check "${PIP_CPU_ARGS[@]}" ./client '.[mooncake]'
exec relayd demo "$@"
