"""Checks on the systemd files: the unit and its example settings, sysusers.

Each is checked by systemd's own tools (systemd-analyze, systemd-sysusers; skipped with
the reason when absent) and by what relayd needs: settings that exist in
``relayd.config``, a socket directory, a clean stop.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from relayd import config
from tests.deploy._files import (
    SETTINGS,
    SYSTEMD,
    flag_setting,
    run_tool,
)


def _unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Sections of a unit file as ordered (key, value) lists; keys may repeat."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        assert current is not None, f"{path}: key outside a section: {line}"
        key, _, value = line.partition("=")
        current.append((key.strip(), value.strip()))
    return sections


def _one(section: list[tuple[str, str]], key: str) -> str:
    values = [v for k, v in section if k == key]
    assert len(values) == 1, f"{key}= appears {len(values)} times"
    return values[0]


def _seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|min|m)?", value)
    assert m, f"unsupported time span {value!r}"
    return float(m.group(1)) * (60 if m.group(2) in ("min", "m") else 1)


@pytest.fixture(scope="module")
def example_settings() -> config.Settings:
    return config.load(config_file=str(SYSTEMD / "relayd.toml"), environ={})


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    """systemd-analyze verify on the unit, with only ExecStart's binary swapped.

    verify refuses a unit whose ExecStart binary does not exist, and
    /usr/local/bin/relayd is not installed here. The copy differs from the real
    unit in that one path and nothing else (asserted below); systemd-analyze
    prints unknown keys and bad values as warnings with exit 0, so any line it
    prints about the unit fails the test too.
    """
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package: systemd)")
    stand_in = shutil.which("true")
    assert stand_in is not None
    original = (SYSTEMD / "relayd.service").read_text()
    binary = "/usr/local/bin/relayd"
    assert original.count(f"ExecStart={binary} ") == 1
    copy = tmp_path / "relayd.service"
    copy.write_text(original.replace(f"ExecStart={binary} ", f"ExecStart={stand_in} "))
    diff = [
        (a, b)
        for a, b in zip(original.splitlines(), copy.read_text().splitlines(), strict=True)
        if a != b
    ]
    assert len(diff) == 1 and diff[0][0].startswith("ExecStart="), diff

    proc = run_tool([analyze, "verify", "--man=no", str(copy)], cwd=tmp_path)
    about_unit = [
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if "relayd.service" in line or str(copy) in line
    ]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not about_unit, "\n".join(about_unit)


def test_systemd_unit_settings(example_settings: config.Settings) -> None:
    unit = _unit(SYSTEMD / "relayd.service")
    svc = unit["Service"]
    assert _one(svc, "Type") == "notify"
    assert _seconds(_one(svc, "WatchdogSec")) == 30
    assert _one(svc, "User") == "relayd"
    assert _one(svc, "Group") == "relayd"
    assert _one(svc, "RuntimeDirectory") == "relayd"
    assert _one(svc, "RuntimeDirectoryPreserve") in ("yes", "no", "restart")
    assert _one(svc, "LimitMEMLOCK") == "infinity"
    assert _one(svc, "Restart") == "on-failure"
    assert _one(svc, "RemoveIPC") == "no"
    assert _one(svc, "KillSignal") == "SIGTERM"
    assert _one(svc, "EnvironmentFile") == "-/etc/relayd/relayd.env"
    # Stopping waits for the drain: the grace period must fit inside the stop timeout.
    assert _seconds(_one(svc, "TimeoutStopSec")) > example_settings.drain_grace
    assert (
        _seconds(_one(svc, "TimeoutStopSec"))
        > config.Settings.__dataclass_fields__["drain_grace"].default
    )

    # Options that would hide /dev/nvidia*, RDMA devices or the host's /dev/shm.
    keys = {k for k, _ in svc}
    hiding = {
        "PrivateDevices",
        "PrivateIPC",
        "PrivateTmp",
        "DeviceAllow",
        "ProtectClock",
        "PrivateUsers",
        "PrivateMounts",
        "TemporaryFileSystem",
        "InaccessiblePaths",
    }
    assert not keys & hiding, keys & hiding
    if "DevicePolicy" in keys:
        assert _one(svc, "DevicePolicy") == "auto"

    exec_start = _one(svc, "ExecStart").split()
    assert exec_start[:2] == ["/usr/local/bin/relayd", "serve"]
    # A named config file that is missing is a startup error, so the unit names it
    # only through the optional environment file (RELAYD_CONFIG).
    assert "--config" not in " ".join(exec_start)
    for arg in exec_start[2:]:
        assert flag_setting(arg) in SETTINGS, arg
    assert unit["Install"] == [("WantedBy", "multi-user.target")]


def test_systemd_examples_are_valid_settings(example_settings: config.Settings) -> None:
    assert example_settings.socket == "/run/relayd/relayd.sock"  # RuntimeDirectory=relayd
    env_keys: dict[str, str] = {}
    for raw in (SYSTEMD / "relayd.env").read_text().splitlines():
        line = raw.lstrip("#").strip()
        if re.match(r"^[A-Z_]+=", line):
            key, _, value = line.partition("=")
            env_keys[key] = value
    assert env_keys["RELAYD_CONFIG"] == "/etc/relayd/relayd.toml"
    for key in env_keys:
        assert key.startswith(config.ENV_PREFIX), key
        assert key == "RELAYD_CONFIG" or key[len(config.ENV_PREFIX) :].lower() in SETTINGS, key
    # The example overrides parse as the settings they name.
    environ = {k: v for k, v in env_keys.items() if k != "RELAYD_CONFIG"}
    config.load(config_file=str(SYSTEMD / "relayd.toml"), environ=environ)


def test_sysusers_creates_relayd(tmp_path: Path) -> None:
    sysusers = shutil.which("systemd-sysusers")
    if sysusers is None:
        pytest.skip("systemd-sysusers is not installed (Debian package: systemd)")
    (tmp_path / "etc").mkdir()
    conf = tmp_path / "usr/lib/sysusers.d/relayd.conf"
    conf.parent.mkdir(parents=True)
    shutil.copy(SYSTEMD / "relayd.sysusers", conf)
    proc = run_tool([sysusers, f"--root={tmp_path}"])
    assert proc.returncode == 0, proc.stderr
    passwd = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "etc/passwd").read_text().splitlines()
    }
    groups = {line.split(":")[0] for line in (tmp_path / "etc/group").read_text().splitlines()}
    assert "relayd" in groups
    assert passwd["relayd"][6] == "/usr/sbin/nologin"
    assert int(passwd["relayd"][2]) < 1000  # a system user
