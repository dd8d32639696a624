"""systemd's notify protocol (``Type=notify``, ``WatchdogSec=``) without libsystemd.

The protocol is one datagram per message on the AF_UNIX socket named by
``NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace), holding
newline-separated ``KEY=VALUE`` lines: ``READY=1``, ``STOPPING=1``,
``STATUS=...``, ``WATCHDOG=1``. Outside systemd there is no socket and every
method is a no-op. Sending never blocks and never raises: a supervisor that
went away must not take the daemon with it, so failures are logged instead.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from types import TracebackType

logger = logging.getLogger(__name__)


class SystemdNotifier:
    """Sends readiness, status, stopping and watchdog messages to systemd."""

    def __init__(self, notify_socket: str | None, watchdog_usec: int | None = None) -> None:
        self._address: str | None = None
        if notify_socket:
            if notify_socket.startswith("@"):
                self._address = "\0" + notify_socket[1:]
            elif notify_socket.startswith("/"):
                self._address = notify_socket
            else:
                logger.warning(
                    "NOTIFY_SOCKET %r is not a path or @name; not notifying", notify_socket
                )
        self._watchdog_usec = watchdog_usec if watchdog_usec and watchdog_usec > 0 else None
        self._sock: socket.socket | None = None
        self._failing = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], *, pid: int | None = None) -> SystemdNotifier:
        """Read NOTIFY_SOCKET, WATCHDOG_USEC and WATCHDOG_PID as systemd sets them.

        The watchdog applies only when WATCHDOG_PID is unset or names ``pid``
        (default: this process), as sd_watchdog_enabled() does.
        """
        usec: int | None = None
        raw = environ.get("WATCHDOG_USEC", "")
        if raw:
            try:
                usec = int(raw)
            except ValueError:
                logger.warning("ignoring WATCHDOG_USEC=%r: not an integer", raw)
        watchdog_pid = environ.get("WATCHDOG_PID", "")
        if usec is not None and watchdog_pid:
            own = os.getpid() if pid is None else pid
            if not watchdog_pid.isdigit() or int(watchdog_pid) != own:
                usec = None
        return cls(environ.get("NOTIFY_SOCKET") or None, usec)

    @property
    def enabled(self) -> bool:
        """True when there is a socket to notify."""
        return self._address is not None

    def watchdog_interval(self) -> float | None:
        """Seconds between :meth:`watchdog` calls (half of WATCHDOG_USEC); None: no watchdog."""
        if self._watchdog_usec is None or not self.enabled:
            return None
        return self._watchdog_usec / 2e6

    def ready(self, status: str = "") -> bool:
        """The daemon serves; systemd finishes starting the unit."""
        return self.notify("READY=1", *([_status_line(status)] if status else []))

    def stopping(self) -> bool:
        """The daemon began draining."""
        return self.notify("STOPPING=1")

    def status(self, text: str) -> bool:
        """Free text shown by ``systemctl status``."""
        return self.notify(_status_line(text))

    def watchdog(self) -> bool:
        """Keep-alive; send every :meth:`watchdog_interval` seconds."""
        return self.notify("WATCHDOG=1")

    def notify(self, *lines: str) -> bool:
        """Send ``lines`` as one message; False without a socket or when sending failed."""
        if self._address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto("\n".join(lines).encode(), self._address)
        except OSError as exc:
            # Warn once per run of failures; a dead supervisor would otherwise flood the log.
            log = logger.debug if self._failing else logger.warning
            log("systemd notify %s failed: %s", lines[0] if lines else "", exc)
            self._failing = True
            return False
        self._failing = False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> SystemdNotifier:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _status_line(text: str) -> str:
    # A newline would start a new KEY=VALUE field.
    return "STATUS=" + " ".join(text.splitlines())
