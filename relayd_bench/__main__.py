"""``python -m relayd_bench``: the same as ``relayd bench``."""

from __future__ import annotations

import sys

from relayd_bench import main

if __name__ == "__main__":  # spawned benchmark processes import this module too
    raise SystemExit(main(sys.argv[1:]))
