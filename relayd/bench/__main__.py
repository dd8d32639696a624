"""``python -m relayd.bench``: the same as ``relayd bench``."""

from __future__ import annotations

import sys

from relayd.bench import main

if __name__ == "__main__":  # spawned benchmark processes import this module too
    raise SystemExit(main(sys.argv[1:]))
