#!/usr/bin/env bash
# Set up a virtual environment, start relayd on the embedded default and run
# the thinker -> talker demo pipeline through it.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q --disable-pip-version-check -c constraints/cpu.txt ./client '.[mooncake]'
exec relayd demo "$@"
