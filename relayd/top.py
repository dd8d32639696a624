"""``relayd top``: the refresh loop around :func:`relayd.status_tables.render_top`.

On a terminal it redraws in place, cut to the terminal's size so the header
never scrolls away, and quits on ``q`` (the terminal is put in cbreak mode
and restored however the loop ends). When the daemon stops it says so and
exits 1, with no traceback.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from relayd_client.wire.proto import relay_pb2 as pb

QUIT_KEYS = frozenset("qQ")
_CLEAR = "\x1b[H\x1b[2J"


def fit(text: str, columns: int, lines: int) -> str:
    """``text`` cut to ``lines`` lines of ``columns`` characters; the last says what was cut."""
    rows = [row[:columns] for row in text.splitlines()]
    if len(rows) > lines:
        cut = len(rows) - lines + 1
        rows = [
            *rows[: lines - 1],
            f"... {cut} more lines (a taller terminal shows them)"[:columns],
        ]
    return "\n".join(rows)


@contextlib.contextmanager
def _keys(stream: TextIO) -> Iterator[Callable[[float], str]]:
    """A ``wait(seconds) -> key or ""``; cbreak mode while inside, when ``stream`` is a tty."""
    try:
        fd = stream.fileno()
        interactive = os.isatty(fd)
    except (OSError, ValueError):
        fd, interactive = -1, False
    if not interactive:

        def sleep(seconds: float) -> str:
            time.sleep(max(seconds, 0.0))
            return ""

        yield sleep
        return
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def wait(seconds: float) -> str:
        deadline = time.monotonic() + max(seconds, 0.0)
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(left, 0.0))
            if ready:
                key = os.read(fd, 1).decode(errors="replace")
                if key in QUIT_KEYS or time.monotonic() >= deadline:
                    return key
                continue
            return ""

    try:
        yield wait
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run(
    fetch: Callable[[], pb.StatusResponse],
    socket_path: str,
    *,
    interval: float,
    iterations: int = 0,
    to_json: Callable[[pb.StatusResponse], str] | None = None,
    unreachable: Callable[[BaseException], str] | None = None,
    out: TextIO | None = None,
    keys: TextIO | None = None,
) -> int:
    """Refresh every ``interval`` seconds (``iterations`` times; 0: until ``q`` or Ctrl-C).

    ``to_json``: print each snapshot as one JSON line instead of the view.
    ``unreachable``: what to say when the first fetch fails.
    """
    from .status_tables import render_top
    from .status_view import status_dict

    out = out or sys.stdout
    previous: dict[str, Any] | None = None
    count = 0
    tty_out = out.isatty()
    try:
        with _keys(keys or sys.stdin) as wait:
            while iterations <= 0 or count < iterations:
                try:
                    reply = fetch()
                except Exception as exc:  # grpc errors: the daemon is gone or unreachable
                    if previous is None and unreachable is not None:
                        print(f"relayd: {unreachable(exc)}", file=sys.stderr)
                        return 1
                    return _gone(socket_path, exc, seen=previous is not None)
                data = status_dict(reply)
                if to_json is not None:
                    out.write(to_json(reply) + "\n")
                else:
                    text = render_top(data, previous, interval)
                    if tty_out:
                        size = shutil.get_terminal_size()
                        text = _CLEAR + fit(text, size.columns, size.lines - 1)
                    out.write(text + "\n")
                out.flush()
                previous = data
                count += 1
                if (iterations <= 0 or count < iterations) and wait(interval) in QUIT_KEYS:
                    return 0
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # `relayd top | head`: the reader is done
        # What is still buffered must not fail again at exit (Python's recipe).
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
    return 0


def _gone(socket_path: str, exc: Exception, *, seen: bool) -> int:
    code = getattr(exc, "code", None)
    why = code().name if callable(code) else type(exc).__name__
    if seen:
        print(f"relayd top: the daemon on {socket_path} stopped ({why}); exiting", file=sys.stderr)
    else:
        print(f"relayd top: cannot reach the daemon on {socket_path} ({why})", file=sys.stderr)
    return 1
