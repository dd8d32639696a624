"""Where the daemon's files are on their defaults, as both programs find them.

A client started without ``socket=`` must arrive at the socket a daemon
started without ``--socket`` listens on, so the default is computed here, once.
"""

from __future__ import annotations

import os
import pathlib
import tempfile

#: Where the arena's segments live (tmpfs).
SHM_DIR = "/dev/shm"
SOCKET_NAME = "relayd.sock"


def default_runtime_dir() -> pathlib.Path:
    """Where the socket goes on the embedded default: systemd's runtime dir, else a temp dir."""
    for var in ("RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"):
        value = os.environ.get(var)
        if value:
            first = value.split(":")[0]
            if os.path.isdir(first) and os.access(first, os.W_OK):
                return pathlib.Path(first) / ("" if var == "RUNTIME_DIRECTORY" else "relayd")
    return pathlib.Path(tempfile.gettempdir()) / f"relayd-{os.getuid()}"


def default_socket_path() -> str:
    """relayd.sock in $RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR/relayd or /tmp/relayd-<uid>."""
    return str(default_runtime_dir() / SOCKET_NAME)
