"""Mooncake's glog lines, re-logged at their own level; expected start-up lines at debug."""

from __future__ import annotations

import logging
import os

import pytest

from relayd.transports._native_log import native_stderr_to_log, relog


def test_glog_levels_map_and_expected_lines_are_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="relayd.transports.mooncake.engine")
    relog(
        "E1201 16:33:11.110180 12436 transfer_metadata.cpp:1098] Local segment descriptor not found"
    )
    relog("E1201 16:33:11.110180 12436 tcp_transport.cpp:77] connect failed: refused")
    relog("W1201 16:33:11.110180 12436 x.cpp:1] disk slow")
    relog("I1201 16:33:11.110180 12436 x.cpp:2] listening")
    got = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert got == [
        (logging.DEBUG, "Local segment descriptor not found (transfer_metadata.cpp:1098)"),
        (logging.ERROR, "connect failed: refused (tcp_transport.cpp:77)"),
        (logging.WARNING, "disk slow (x.cpp:1)"),
        (logging.DEBUG, "listening (x.cpp:2)"),
    ]


def test_native_writes_to_fd2_are_captured_and_relogged(
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG, logger="relayd.transports.mooncake.engine")
    with native_stderr_to_log():
        os.write(2, b"E1201 16:33:11.110180 1 t.cpp:9] real trouble\nplain text\n")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.ERROR, "real trouble (t.cpp:9)")
    ]
    assert capfd.readouterr().err == "plain text\n"
