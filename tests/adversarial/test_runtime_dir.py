"""The socket directory and lock file cannot be taken over, and a client talks only to a
daemon of a uid it trusts (real users: see _users)."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator

import pytest
from relayd_client import PermissionDeniedError, RelayClient

from tests._daemon import Daemon, wait_until
from tests.adversarial._users import DAEMON, OTHER, STAGE, User, run_as, shared_dir
from tests.faults._support import unique_node

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def tmpdir_shared() -> Iterator[str]:
    path = shared_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _serve(socket: str, *args: str, user: User | None = None, env: dict[str, str] | None = None
           ) -> subprocess.Popen[bytes]:  # fmt: skip
    argv = [sys.executable, "-m", "relayd", "serve", "--socket", socket, "--shm-pool-size",
            "16MiB", "--node-id", unique_node(), "--drain-grace", "1", *args]  # fmt: skip
    if user is not None:
        argv = user.argv(argv)
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )


def _refused(proc: subprocess.Popen[bytes], socket: str) -> str:
    """The daemon must exit with a message instead of serving; returns its output."""
    try:
        wait_until(lambda: proc.poll() is not None or os.path.exists(socket), 30, "relayd to exit")
        served = proc.poll() is None
    finally:
        if proc.poll() is None:
            proc.terminate()
        out = proc.communicate(timeout=30)[0].decode()
    assert not served, f"relayd served on {socket}:\n{out}"
    assert proc.returncode != 0, out
    return out


def test_daemon_refuses_socket_directory_precreated_by_another_user(
    users: dict[str, User], tmpdir_shared: str
) -> None:
    # /tmp/relayd-<uid> created first by another user, as open as they like.
    taken = os.path.join(tmpdir_shared, f"relayd-{os.getuid()}")
    os.mkdir(taken)
    os.chown(taken, users[OTHER].uid, users[OTHER].gid)
    os.chmod(taken, 0o777)
    out = _refused(_serve(os.path.join(taken, "relayd.sock")), os.path.join(taken, "relayd.sock"))
    assert "could be changed by another user" in out and taken in out, out
    assert os.listdir(taken) == []  # not even a lock file was written there


def test_daemon_refuses_a_group_writable_directory(tmpdir_shared: str) -> None:
    loose = os.path.join(tmpdir_shared, "run")
    os.mkdir(loose)
    os.chmod(loose, 0o770)
    out = _refused(_serve(os.path.join(loose, "relayd.sock")), os.path.join(loose, "relayd.sock"))
    assert "not writable by group or others" in out, out


def test_lock_file_symlink_is_not_followed(tmpdir_shared: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("the overwrite that matters is of a root-only file")
    run = os.path.join(tmpdir_shared, "run")
    os.mkdir(run, 0o700)
    victim = os.path.join(tmpdir_shared, "precious")
    with open(victim, "w") as fh:
        fh.write("precious\n")
    os.symlink(victim, os.path.join(run, "relayd.sock.lock"))
    out = _refused(_serve(os.path.join(run, "relayd.sock")), os.path.join(run, "relayd.sock"))
    assert "symlink" in out, out
    with open(victim) as fh:
        assert fh.read() == "precious\n"


def test_default_directory_is_created_private(tmpdir_shared: str) -> None:
    # Neither RUNTIME_DIRECTORY nor XDG_RUNTIME_DIR: the temp-dir default.
    env = {k: v for k, v in os.environ.items() if k not in ("RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR")}
    env["TMPDIR"] = tmpdir_shared
    d = Daemon(tmpdir_shared, node_id=unique_node())
    i = d.args.index("--socket")
    del d.args[i : i + 2]
    d.socket = os.path.join(tmpdir_shared, f"relayd-{os.getuid()}", "relayd.sock")
    d.env = env
    d.start()
    try:
        st = os.stat(os.path.dirname(d.socket))
        # Owner rwx, the sockets' group may enter and list; nobody else, nobody may write.
        assert stat.S_IMODE(st.st_mode) == 0o750
        assert st.st_uid == os.geteuid()
    finally:
        d.stop()


def test_client_refuses_a_daemon_of_another_uid(users: dict[str, User]) -> None:
    """The victim (root here) finds a daemon another user started at its socket path."""
    attacker = users[OTHER]
    taken = shared_dir(attacker, 0o755)
    sock = os.path.join(taken, "relayd.sock")
    d = Daemon(taken, node_id=unique_node())
    d.args = attacker.argv(d.args)
    d.log_path = os.path.join(shared_dir(), "daemon.log")
    try:
        d.start()
        assert os.stat(sock).st_uid == attacker.uid

        async def victim() -> None:
            async with RelayClient("thinker", sock, timeout=5):
                pass

        with pytest.raises(PermissionDeniedError, match=f"runs as uid {attacker.uid}"):
            asyncio.run(asyncio.wait_for(victim(), 60))
        # Pinned to that uid on purpose, the same client attaches.
        os.environ["RELAYD_DAEMON_UID"] = str(attacker.uid)
        try:
            asyncio.run(asyncio.wait_for(victim(), 60))
        finally:
            del os.environ["RELAYD_DAEMON_UID"]
    finally:
        d.stop()
        shutil.rmtree(taken, ignore_errors=True)


def test_permission_denied_says_who_is_admitted(users: dict[str, User]) -> None:
    home = shared_dir()
    d = Daemon(home, node_id=unique_node()).start()
    try:
        answer = run_as(users[OTHER], ["attach", d.socket, "thinker"])
        assert answer.get("error") == "PermissionDeniedError", answer
        assert "permission denied" in answer["message"]
        assert "usermod -aG root" in answer["message"], answer
        assert "relayd serve" not in answer["message"]
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)


def test_stage_user_trusts_the_daemon_holding_its_runtime_directory(
    users: dict[str, User],
) -> None:
    """Like systemd's /run/relayd: owned by the daemon's user, 0750, under root's /run."""
    daemon = users[DAEMON]
    run = shared_dir(daemon, 0o750, parent="/run" if os.path.isdir("/run") else "/var/run")
    in_tmp = shared_dir(daemon, 0o750)
    logs = shared_dir()
    daemons = []
    try:
        for where in (run, in_tmp):
            d = Daemon(where, node_id=unique_node())
            d.args = daemon.argv(d.args)
            d.log_path = os.path.join(logs, f"{len(daemons)}.log")
            daemons.append(d.start())
        held, loose = daemons
        assert run_as(users[STAGE], ["attach", held.socket, "thinker"]).get("ok") is True
        # Under /tmp, writable by everyone, the directory proves nothing: pin the uid.
        answer = run_as(users[STAGE], ["attach", loose.socket, "thinker"])
        assert answer.get("error") == "PermissionDeniedError", answer
        pinned = {"RELAYD_DAEMON_UID": daemon.name}
        assert run_as(users[STAGE], ["attach", loose.socket, "thinker"], env=pinned)["ok"] is True
    finally:
        for d in daemons:
            d.stop()
        for path in (run, in_tmp, logs):
            shutil.rmtree(path, ignore_errors=True)
