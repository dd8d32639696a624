"""Mooncake's own log lines (glog, written by C++ straight to fd 2) through relayd's log.

While an engine is imported and initialised, fd 2 points at a temporary file;
afterwards each line goes to :mod:`logging` at the level glog gave it, in
relayd's format. Lines Mooncake prints on every healthy start at ERROR or
WARNING level are logged at DEBUG: an operator who sees an error line at
every start learns to ignore error lines. Whatever else was written to fd 2
meanwhile (another thread's log line) is written back unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator

logger = logging.getLogger("relayd.transports.mooncake.engine")

# I1201 16:33:11.110051 12436 transfer_engine_impl.cpp:1046] message
_GLOG = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ ([\w.]+:\d+)\] (.*)$")
_LEVEL = {"I": logging.DEBUG, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
# Printed by every healthy start; what they say is not a fault.
_EXPECTED = (
    # The engine looks up its own segment before anything is registered.
    "Local segment descriptor not found",
    # glog announces it is not initialised (Mooncake never calls InitGoogleLogging).
    "Logging before InitGoogleLogging()",
    # The TCP protocol has no registered allocator; malloc/free is its normal path.
    "Using default malloc/free for protocol",
)


def relog(line: str) -> None:
    """One captured line to the log (glog lines) or back to stderr (anything else)."""
    if not line.strip():
        return
    m = _GLOG.match(line)
    expected = any(text in line for text in _EXPECTED)
    if m is None:
        if expected:
            logger.debug("%s", line)
        else:
            os.write(2, (line + "\n").encode(errors="replace"))
        return
    level, where, message = m.groups()
    logger.log(logging.DEBUG if expected else _LEVEL[level], "%s (%s)", message, where)


@contextlib.contextmanager
def native_stderr_to_log() -> Iterator[None]:
    """Capture fd 2 for the duration (call from one thread at a time)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(ValueError, OSError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines():
                relog(line)
