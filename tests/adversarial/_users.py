"""Real local users for the trust-boundary tests, and how to run a process as one of them.

CI runs as root; the users are created once per host with ``useradd`` and kept
(creating them is idempotent). Their roles:

- ``relayd-t-daemon``: runs the daemon; its group is the daemon's group;
- ``relayd-t-stage``: a stage user whose *primary* group is the daemon's group;
- ``relayd-t-supp``: a stage user who is only a *supplementary* member of it
  (``usermod -aG``, as deploy/README.md tells operators to admit stage users);
- ``relayd-t-other``: an unrelated local user.
"""

from __future__ import annotations

import dataclasses
import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import pytest

DAEMON, STAGE, SUPP, OTHER = "relayd-t-daemon", "relayd-t-stage", "relayd-t-supp", "relayd-t-other"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int

    def argv(self, args: Sequence[str]) -> list[str]:
        """``args`` run as this user, with its primary and supplementary groups."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups", *args]


def _run(*argv: str) -> None:
    # Other suites may be editing /etc/passwd at the same moment: retry on its lock.
    for _ in range(20):
        cp = subprocess.run(argv, capture_output=True, timeout=30)
        if cp.returncode in (0, 9):  # 9: already exists
            return
        if b"lock" not in cp.stderr:
            raise RuntimeError(f"{argv}: {cp.stderr.decode()}")
    raise RuntimeError(f"{argv}: /etc/passwd stayed locked")


def _user(name: str) -> User:
    pw = pwd.getpwnam(name)
    return User(name, pw.pw_uid, pw.pw_gid)


def ensure_users() -> dict[str, User]:
    """Create the four users if needed; skip the test where that is impossible."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create users and run processes as them")
    for tool in ("useradd", "usermod", "groupadd", "setpriv"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} to create users and run processes as them")
    nologin = shutil.which("nologin") or "/bin/false"
    _run("groupadd", "-f", DAEMON)
    for name, opts in (
        (DAEMON, ["-g", DAEMON]),
        (STAGE, ["-g", DAEMON]),
        (SUPP, ["-U"]),
        (OTHER, ["-U"]),
    ):
        try:
            pwd.getpwnam(name)
        except KeyError:
            _run("useradd", "-M", "-s", nologin, *opts, name)
    if SUPP not in grp.getgrnam(DAEMON).gr_mem:
        _run("usermod", "-aG", DAEMON, SUPP)
    return {n: _user(n) for n in (DAEMON, STAGE, SUPP, OTHER)}


def shared_dir(owner: User | None = None, mode: int = 0o755, parent: str = "/tmp") -> str:
    """A directory the test users can reach (pytest's tmp_path is root-only)."""
    path = tempfile.mkdtemp(prefix="relayd-t-", dir=parent)
    os.chmod(path, mode)
    if owner is not None:
        os.chown(path, owner.uid, owner.gid)
    return path


def run_as(
    user: User, args: Sequence[str], timeout: float = 60, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """``python -m tests.adversarial._as_user ARGS`` as ``user``; its JSON answer."""
    cp = subprocess.run(
        user.argv([sys.executable, "-m", "tests.adversarial._as_user", *args]),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1", **(env or {})},
    )
    lines = cp.stdout.strip().splitlines()
    if cp.returncode != 0 or not lines:
        raise AssertionError(f"{args} as {user.name} failed ({cp.returncode}):\n{cp.stderr}")
    answer: dict[str, Any] = json.loads(lines[-1])
    return answer
