"""Commands the README tells an operator to paste, run as written."""

from __future__ import annotations

import re
import stat
import subprocess
from pathlib import Path

from relayd.peer_links import load_token

REPO = Path(__file__).resolve().parents[2]
TOOL_TIMEOUT = 30


def test_peer_token_command_makes_a_private_token_relayd_accepts(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    m = re.search(r"(?m)^# once, then copy to every node.*\n((?:.+\n)+?)\n", readme)
    assert m, "README's peer token block not found"
    etc = tmp_path / "etc" / "relayd"  # does not exist yet, as on a fresh node
    lines = [
        line.replace("/etc/relayd", str(etc))
        for line in m.group(1).splitlines()
        if not line.startswith("chown ")  # no relayd user here; mode is what is checked
    ]
    cp = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", "umask 022\n" + "\n".join(lines)],
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT,
        check=False,
    )
    assert cp.returncode == 0, cp.stderr
    token = etc / "peer-token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert len(load_token(str(token))) >= 32


def test_example_config_agrees_with_deploy_readme() -> None:
    """The systemd example leaves the arena to relayd, and deploy/README names every
    default it does change."""
    import tomllib

    from relayd import config

    text = (REPO / "deploy" / "systemd" / "relayd.toml").read_text()
    table = tomllib.loads(text).get("relayd", {})
    assert "shm_pool_size" not in table
    deploy_readme = (REPO / "deploy" / "README.md").read_text()
    assert "keeps the arena sized to the machine" in deploy_readme
    for key in ("metrics_address", "health_address"):
        default = config.Settings.__dataclass_fields__[key].default
        if table.get(key, default) != default:
            assert f"`{table[key]}`" in deploy_readme, key
