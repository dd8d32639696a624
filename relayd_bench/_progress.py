"""Progress on stderr that never floods: one rewritten line on a terminal, sparse lines in a log."""

from __future__ import annotations

import sys
import time
from typing import TextIO

TTY_INTERVAL_S = 0.2  # at most ~5 redraws a second
LOG_INTERVAL_S = 2.0  # a log file gets a line every few seconds, plus one per finished cell


class Progress:
    def __init__(self, stream: TextIO | None = None, enabled: bool = True) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled
        self._tty = self._stream.isatty()
        self._interval = TTY_INTERVAL_S if self._tty else LOG_INTERVAL_S
        self._last = 0.0
        self._width = 0  # of the line currently on screen, so a shorter one can blank it
        self._text = ""  # a stalled counter is not news

    def update(self, text: str) -> None:
        """Show transient status; dropped when the last one was shown less than an interval ago."""
        now = time.monotonic()
        if not self._enabled or now - self._last < self._interval or text == self._text:
            return
        self._last, self._text = now, text
        if self._tty:
            self._stream.write("\r" + text.ljust(self._width))
            self._width = len(text)
        else:
            self._stream.write(text + "\n")
        self._stream.flush()

    def line(self, text: str) -> None:
        """A permanent line (a finished cell, a warning); always shown."""
        if not self._enabled:
            return
        if self._tty:
            self._stream.write("\r" + text.ljust(self._width) + "\n")
            self._width = 0
        else:
            self._stream.write(text + "\n")
        self._stream.flush()
        self._last, self._text = 0.0, ""
