from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from relayd import _logging
from relayd._logging import JsonFormatter, LogfmtFormatter, TextFormatter, configure

CREATED = 1714564800.123  # 2024-05-01T12:00:00.123Z
TS = "2024-05-01T12:00:00.123Z"


def record(
    msg: str = "lease %s reclaimed",
    args: tuple[Any, ...] = (17,),
    level: int = logging.INFO,
    extra: dict[str, Any] | None = None,
    exc: bool = False,
) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    rec = logging.getLogger("relayd.pools.leases").makeRecord(
        "relayd.pools.leases", level, "leases.py", 10, msg, args, exc_info, extra=extra
    )
    rec.created = CREATED
    return rec


EXTRA = {"lease_id": 17, "request_id": "r 1", "session_id": "s-a1", "stage": "thinker"}


def test_json_one_object_per_line_with_extras() -> None:
    line = JsonFormatter().format(record(extra=EXTRA))
    assert "\n" not in line
    obj = json.loads(line)
    assert obj == {
        "ts": TS,
        "level": "info",
        "logger": "relayd.pools.leases",
        "msg": "lease 17 reclaimed",
        "lease_id": 17,
        "request_id": "r 1",
        "session_id": "s-a1",
        "stage": "thinker",
    }
    assert list(obj)[:4] == ["ts", "level", "logger", "msg"]


def test_json_unserializable_extra_and_exception() -> None:
    obj = json.loads(
        JsonFormatter().format(record(extra={"stages": ("a", "b"), "obj": object}, exc=True))
    )
    assert obj["stages"] == ["a", "b"]
    assert obj["obj"] == "<class 'object'>"
    assert obj["exc"].startswith("Traceback (most recent call last):")
    assert obj["exc"].endswith("ValueError: boom")


def test_json_extras_cannot_override_core_fields() -> None:
    obj = json.loads(JsonFormatter().format(record(extra={"level": "fake", "ts": 0})))
    assert obj["level"] == "info"
    assert obj["ts"] == TS


def test_logfmt_quotes_what_needs_quoting() -> None:
    extra = {**EXTRA, "note": 'say "hi"\\now', "empty": "", "ok": True, "none": None}
    assert LogfmtFormatter().format(record(extra=extra)) == (
        f'ts={TS} level=info logger=relayd.pools.leases msg="lease 17 reclaimed" lease_id=17 '
        'request_id="r 1" session_id=s-a1 stage=thinker note="say \\"hi\\"\\\\now" empty="" '
        "ok=true none="
    )


def test_logfmt_escapes_newlines() -> None:
    line = LogfmtFormatter().format(record(msg="two\nlines", args=(), extra={"k": "a=b"}))
    assert line == f'ts={TS} level=info logger=relayd.pools.leases msg="two\\nlines" k="a=b"'


def test_text_shows_extras() -> None:
    assert TextFormatter().format(record(level=logging.WARNING, extra=EXTRA)) == (
        f'{TS} WARNING relayd.pools.leases: lease 17 reclaimed lease_id=17 request_id="r 1" '
        "session_id=s-a1 stage=thinker"
    )
    assert TextFormatter().format(record()) == f"{TS} INFO relayd.pools.leases: lease 17 reclaimed"


def test_text_appends_traceback() -> None:
    lines = TextFormatter().format(record(exc=True)).splitlines()
    assert lines[0] == f"{TS} INFO relayd.pools.leases: lease 17 reclaimed"
    assert lines[1] == "Traceback (most recent call last):"
    assert lines[-1] == "ValueError: boom"


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    if _logging._handler is not None:
        root.removeHandler(_logging._handler)
        _logging._handler = None
    root.handlers[:] = handlers
    root.setLevel(level)


def test_configure_installs_one_handler(root_logger: logging.Logger) -> None:
    first, second = io.StringIO(), io.StringIO()
    configure("json", "info", stream=first)
    configure("logfmt", "WARNING", stream=second)
    log = logging.getLogger("relayd.test")
    log.info("hidden")
    log.warning("shown", extra={"request_id": "r1"})
    assert first.getvalue() == ""
    out = second.getvalue()
    assert out.count("\n") == 1
    assert out.endswith(" level=warning logger=relayd.test msg=shown request_id=r1\n")
    assert root_logger.level == logging.WARNING


def test_configure_json_end_to_end(root_logger: logging.Logger) -> None:
    stream = io.StringIO()
    configure("json", "debug", stream=stream)
    logging.getLogger("relayd.server").debug("granted %d bytes", 4096, extra={"session_id": "s1"})
    obj = json.loads(stream.getvalue())
    del obj["ts"]
    assert obj == {
        "level": "debug",
        "logger": "relayd.server",
        "msg": "granted 4096 bytes",
        "session_id": "s1",
    }


@pytest.mark.parametrize(
    ("fmt", "level", "message"),
    [
        ("xml", "info", "log format must be text, json or logfmt, not 'xml'"),
        (
            "text",
            "loud",
            "log level must be one of debug, info, warning, error, critical, not 'loud'",
        ),
    ],
)
def test_configure_rejects_unknown(
    root_logger: logging.Logger, fmt: str, level: str, message: str
) -> None:
    with pytest.raises(ValueError) as info:
        configure(fmt, level, stream=io.StringIO())
    assert str(info.value) == message
