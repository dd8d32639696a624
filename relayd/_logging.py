"""Log output formats for the CLI: ``text``, ``json`` and ``logfmt``.

Only the CLI calls :func:`configure`; library modules just log to
``logging.getLogger(__name__)`` and pass context as ``extra``::

    logger.info("lease reclaimed", extra={"lease_id": 17, "request_id": "r1"})

Every format shows those extra fields. ``json`` writes one object per line
with ``ts``, ``level``, ``logger`` and ``msg`` first; ``logfmt`` writes
``key=value`` pairs, quoting values that need it.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any, TextIO

from relayd_client.wire.names import printable

LEVELS = ("debug", "info", "warning", "error", "critical")

# Attributes every LogRecord has; anything else on a record came from ``extra``.
_RECORD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}

_handler: logging.Handler | None = None


def configure(fmt: str, level: str, *, stream: TextIO | None = None) -> None:
    """Send all logging to ``stream`` (default stderr) in ``fmt`` at ``level``.

    Calling it again replaces the handler it installed before.
    """
    global _handler
    if level.lower() not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, not {level!r}")
    formatter = make_formatter(fmt)
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
    root.addHandler(handler)
    root.setLevel(level.upper())
    _handler = handler


def make_formatter(fmt: str) -> logging.Formatter:
    formatters: dict[str, type[logging.Formatter]] = {
        "text": TextFormatter,
        "json": JsonFormatter,
        "logfmt": LogfmtFormatter,
    }
    try:
        return formatters[fmt]()
    except KeyError:
        raise ValueError(f"log format must be text, json or logfmt, not {fmt!r}") from None


def extras(record: logging.LogRecord) -> dict[str, Any]:
    """The ``extra`` fields of ``record``, in the order they were given."""
    return {k: v for k, v in record.__dict__.items() if k not in _RECORD_ATTRS}


def _timestamp(record: logging.LogRecord) -> str:
    ts = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
    return ts.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return str(value)


class TextFormatter(logging.Formatter):
    """``2024-05-01T12:00:00.000Z INFO relayd.server: message key=value ...``"""

    def format(self, record: logging.LogRecord) -> str:
        # One record, one line: a client's request id must not forge another record
        # or reach the operator's terminal as escape sequences.
        message = printable(record.getMessage())
        line = f"{_timestamp(record)} {record.levelname} {record.name}: {message}"
        fields = extras(record)
        if fields:
            line += " " + " ".join(f"{k}={_logfmt_value(v)}" for k, v in fields.items())
        return self._with_exception(line, record)

    def _with_exception(self, line: str, record: logging.LogRecord) -> str:
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in extras(record).items():
            obj.setdefault(key, _jsonable(value))
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            obj["stack"] = self.formatStack(record.stack_info)
        return json.dumps(obj, ensure_ascii=False)


class LogfmtFormatter(logging.Formatter):
    """``ts=... level=info logger=relayd.server msg="lease freed" lease_id=17``"""

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in extras(record).items():
            fields.setdefault(key, value)
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            fields["stack"] = self.formatStack(record.stack_info)
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in fields.items())


def _logfmt_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if text and not any(c in text for c in ' ="\\') and text.isprintable():
        return text
    escaped = (
        text.replace("\\", "\\\\")
        .replace('"', '\\"')
        .replace("\n", "\\n")
        .replace("\r", "\\r")
        .replace("\t", "\\t")
    )
    return f'"{printable(escaped)}"'
