"""``relayd serve`` with a ``--stage-owner`` it cannot use exits 2 before it starts,
with one line saying what is wrong, whichever way the setting came."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

from tests.integration.test_preflight_cli import EXIT_PREFLIGHT, TIMEOUT, child_env, serve_command


def _serve(sock: pathlib.Path, *flags: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        serve_command(sock, *flags),
        env={**child_env(), **(env or {})},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == EXIT_PREFLIGHT, result.stderr
    assert not sock.exists()  # refused before anything was created
    return result.stderr


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("talker=abc", "uid 'abc' of stage 'talker' is not an integer"),
        ("=1001", "stage name '' must be"),
        ("bad!name=1001", "stage name 'bad!name' must be"),
        ("talker", "'talker' is not STAGE=UID[,UID...]"),
    ],
)
def test_a_bad_flag_is_refused_in_one_line(tmp_path: pathlib.Path, value: str, says: str) -> None:
    stderr = _serve(tmp_path / "s.sock", "--stage-owner", "thinker=1003", "--stage-owner", value)
    assert stderr.startswith("relayd: stage_owner: ") and stderr.count("\n") == 1, stderr
    assert says in stderr


def test_a_bad_environment_value_is_refused_in_one_line(tmp_path: pathlib.Path) -> None:
    stderr = _serve(tmp_path / "s.sock", env={"RELAYD_STAGE_OWNER": "talker=1001;thinker=x"})
    assert stderr == "relayd: stage_owner: uid 'x' of stage 'thinker' is not an integer\n"


def test_a_bad_config_file_value_is_refused_in_one_line(tmp_path: pathlib.Path) -> None:
    cfg = tmp_path / "relayd.toml"
    cfg.write_text('[relayd.stage_owner]\n"talker" = [1001, "me"]\n')
    stderr = _serve(tmp_path / "s.sock", "--config", str(cfg))
    assert stderr == "relayd: stage_owner: uid 'me' of stage 'talker' is not an integer\n"
