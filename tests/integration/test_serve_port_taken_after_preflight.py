"""A port taken between preflight and the daemon's bind is refused as preflight refuses it.

Preflight probes each TCP port and lets it go; whatever takes the port before
the server binds it must not turn a configuration error into a traceback. The
real ``relayd serve`` runs in a child process whose preflight, once its real
checks have passed, takes the port with a listening socket: the bind that
follows meets the conflict preflight could not see.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

from tests._daemon import free_port
from tests._mooncake import requires_mooncake
from tests.integration.test_preflight_cli import assert_refused, run, serve_command

pytestmark = pytest.mark.timeout(120)

# Preflight passes, then the port is taken: the race, made certain.
CHILD = """
import socket, sys
from relayd import cli, preflight

setting, argv = sys.argv[1], sys.argv[2:]
check_all, held = preflight.check_all, []

def check_then_take(settings, **kw):
    check_all(settings, **kw)
    host, port = preflight.parse_host_port(getattr(settings, setting))
    sock = socket.socket()
    sock.bind((host, port))
    sock.listen()
    held.append(sock)

preflight.check_all = check_then_take
sys.exit(cli.main(argv))
"""


def _serve_taking(setting: str, sock: pathlib.Path, *flags: str) -> None:
    address = f"127.0.0.1:{free_port()}"
    flag = "--" + setting.replace("_", "-")
    argv = serve_command(sock, flag, address, *flags)[3:]  # after `python -m relayd`
    result = run([sys.executable, "-c", CHILD, setting, *argv])
    assert "Traceback" not in result.stderr, result.stderr
    assert_refused(
        result,
        f"{setting} {address}: the port is taken (address already in use); stop what "
        f"listens there or choose another port with {flag}",
    )


@pytest.mark.parametrize("setting", ["health_address", "metrics_address"])
def test_a_port_taken_after_preflight_is_a_preflight_failure(
    tmp_path: pathlib.Path, setting: str
) -> None:
    _serve_taking(setting, tmp_path / "s.sock")


@requires_mooncake
def test_a_peer_port_taken_after_preflight_is_a_preflight_failure(tmp_path: pathlib.Path) -> None:
    token = tmp_path / "token"
    token.write_text("0123456789abcdef-peer-token\n")
    token.chmod(0o600)
    _serve_taking("peer_address", tmp_path / "s.sock", "--peer-token-file", str(token))
