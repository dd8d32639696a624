"""Admission means the same everywhere: on the session socket, on the arena's files and
on every RPC (real users: see _users)."""

from __future__ import annotations

import os

import grpc
import pytest
from relayd_client.wire.proto import relay_pb2 as pb

from tests._daemon import Daemon
from tests.adversarial._raw import stub
from tests.adversarial._users import (
    DAEMON,
    OTHER,
    STAGE,
    SUPP,
    User,
    run_as,
    shared_dir,
)
from tests.faults._support import unique_node

pytestmark = pytest.mark.timeout(180)


def _daemon_as(user: User, where: str, *args: str) -> Daemon:
    d = Daemon(where, *args, node_id=unique_node())
    d.args = user.argv(d.args)
    d.log_path = os.path.join(shared_dir(), "daemon.log")
    return d.start()


def test_supplementary_group_member_is_admitted_and_maps(
    users: dict[str, User], run_dir: str
) -> None:
    """deploy/README.md: `usermod -aG relayd <stage-user>` admits that user."""
    d = _daemon_as(users[DAEMON], run_dir)
    try:
        answer = run_as(users[SUPP], ["attach", d.socket, "thinker"])
        assert answer.get("ok") is True, answer
        assert answer["socket_fallback"] is False  # it maps the arena, as its groups allow
        # The primary-group stage user, as before.
        assert run_as(users[STAGE], ["attach", d.socket, "talker"]).get("ok") is True
    finally:
        d.stop()


def test_who_is_refused_a_session_cannot_map_the_arena(
    users: dict[str, User], run_dir: str
) -> None:
    # Admit another group than the daemon's: members of the daemon's group (SUPP) are
    # then refused, and must not be able to open the segments either.
    other = users[OTHER]
    d = _daemon_as(users[DAEMON], run_dir, "--socket-mode", "0666", "--allow-gid", str(other.gid))
    try:
        refused = run_as(users[SUPP], ["attach", d.socket, "thinker"])
        assert refused.get("error") == "PermissionDeniedError", refused
        mapped = run_as(users[SUPP], ["map", f"relayd.{d.node_id}.{d.epoch}."])
        assert mapped == {"mapped": 0, "denied": len(d.segments()) - 1}, mapped
        # The admitted group cannot map either (the files are the daemon's alone
        # now): its bytes go over the socket fallback, checked end to end.
        admitted = run_as(other, ["attach", d.socket, "talker"])
        assert admitted.get("ok") is True and admitted["socket_fallback"] is True, admitted
    finally:
        d.stop()


def test_an_unbound_session_can_do_nothing_but_bind(tmp_path: object) -> None:
    d = Daemon(str(tmp_path), node_id=unique_node()).start()
    try:
        with stub(d.socket) as s:
            a = s.Attach(pb.AttachRequest(protocol_version=1, stages=["x"], pid=1), timeout=5)
            calls = {
                "Abort": lambda: s.Abort(
                    pb.AbortRequest(
                        session_id=a.session_id, session_token=a.session_token, request_id="r1"
                    ),
                    timeout=5,
                ),
                "Status": lambda: s.Status(
                    pb.StatusRequest(session_id=a.session_id, session_token=a.session_token),
                    timeout=5,
                ),
                "Status(no session)": lambda: s.Status(pb.StatusRequest(), timeout=5),
                "Drain": lambda: s.Drain(
                    pb.DrainRequest(session_id=a.session_id, session_token=a.session_token),
                    timeout=5,
                ),
                "Drain(no session)": lambda: s.Drain(pb.DrainRequest(), timeout=5),
            }
            codes = {}
            for name, call in calls.items():
                try:
                    call()
                    codes[name] = "OK"
                except grpc.RpcError as err:
                    codes[name] = err.code().name
        assert "OK" not in codes.values(), codes
        assert codes["Status(no session)"] == codes["Drain(no session)"] == "PERMISSION_DENIED"
        assert d.proc is not None and d.proc.poll() is None  # not drained
        assert d.status()["state"] == "DAEMON_STATE_SERVING"
    finally:
        d.stop()


def test_status_details_and_drain_are_for_operators(users: dict[str, User], run_dir: str) -> None:
    d = _daemon_as(users[DAEMON], run_dir)
    try:
        stage = run_as(users[STAGE], ["operate", d.socket, "thinker"])
        # A stage sees the pools, not who runs what, and cannot drain.
        assert stage == {"sessions": 0, "pools": 1, "stages": 0, "drain": "PERMISSION_DENIED"}
        # The operator (root here; the daemon's uid or --admin-gid too) sees everything.
        full = d.status()
        assert full["state"] == "DAEMON_STATE_SERVING"
    finally:
        d.stop()
    d = _daemon_as(users[DAEMON], run_dir, "--admin-gid", str(users[DAEMON].gid))
    try:
        admin = run_as(users[STAGE], ["operate", d.socket, "thinker"])
        assert admin["sessions"] == 1 and admin["stages"] >= 1 and admin["drain"] == "OK", admin
    finally:
        d.stop()
