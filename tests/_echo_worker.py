"""A worker for the zygote's own tests: ``python -m tests._echo_worker``.

Reads commands from stdin, one per line: ``echo TEXT`` answers TEXT, ``env NAME``
answers that variable, ``exit N`` exits with N, ``stderr TEXT`` writes TEXT to
stderr; EOF exits 0.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    for line in sys.stdin:
        cmd, _, arg = line.rstrip("\n").partition(" ")
        if cmd == "echo":
            print(arg, flush=True)
        elif cmd == "env":
            print(os.environ.get(arg, "<unset>"), flush=True)
        elif cmd == "stderr":
            print(arg, file=sys.stderr)
        elif cmd == "exit":
            return int(arg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
