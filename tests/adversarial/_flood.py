"""Idle-connection flood against a daemon, run as another uid by test_bounds.

Opens N connections to each socket; on the session socket each sends a frame
header claiming MAX_FRAME bytes followed by PARTIAL bytes of body (a frame that
never completes), on the gRPC socket nothing. Prints "ready N_SESSION N_GRPC"
(how many connects succeeded), then holds everything until stdin closes.
Standard library only.
"""

from __future__ import annotations

import resource
import socket
import struct
import sys

MAX_FRAME = 4 << 20
PARTIAL = 60 << 10


def main(session_path: str, grpc_path: str, n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * n + 64)), hard))
    held: list[socket.socket] = []
    counts = []
    for path, payload in (
        (session_path, struct.pack("<I", MAX_FRAME) + b"\0" * PARTIAL),
        (grpc_path, b""),
    ):
        ok = 0
        for _ in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            try:
                s.connect(path)
                if payload:
                    s.sendall(payload)
            except OSError:
                s.close()
                continue
            held.append(s)
            ok += 1
        counts.append(ok)
    print("ready", *counts, flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
