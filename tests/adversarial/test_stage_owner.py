"""``--stage-owner``: a stage with an owner list is served only by the uids it lists
(and root and the daemon's uid). Another admitted uid that declares the stage is
refused at bind, counted and logged, and the stage's real reader keeps its puts.
Stages without a list stay open (real users: see _users)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import select
import subprocess
import sys
from typing import Any

import pytest
from relayd_client import RelayClient

from tests._daemon import Daemon, metric
from tests.adversarial._users import (
    DAEMON,
    ROOT,
    STAGE,
    SUPP,
    User,
    run_as,
    shared_dir,
)
from tests.faults._support import unique_node

pytestmark = pytest.mark.timeout(180)

KEY = "owned-1"
# Bounds on the reader process: bound within the first, done within the second.
BIND_TIMEOUT, READ_TIMEOUT = 60.0, 90.0


def _daemon(users: dict[str, User], where: str) -> Daemon:
    """The daemon as its own user; "talker" is the stage user's alone."""
    d = Daemon(
        where, "--stage-owner", f"talker={users[STAGE].uid}", node_id=unique_node(), metrics=True
    )
    d.args = users[DAEMON].argv(d.args)
    d.log_path = os.path.join(shared_dir(), "daemon.log")
    return d.start()


def _payload() -> tuple[Any, str]:
    import torch

    data = torch.arange(1 << 18, dtype=torch.int32)
    return data, hashlib.sha256(data.numpy().tobytes()).hexdigest()


def _line(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no answer from the reader within {timeout}s"
    answer: dict[str, Any] = json.loads(proc.stdout.readline())
    return answer


async def _put_to_talker(socket: str, reader: subprocess.Popen[str]) -> tuple[str, dict[str, Any]]:
    """A keyed put for "talker" (as root, stage "thinker"); what the reader read of it."""
    data, digest = _payload()
    async with RelayClient("thinker", socket, timeout=10) as c:
        await c.put({"x": data}, to_stage="talker", request_id="owned", key=KEY)
        # The writer stays until the reader is done with its lease.
        out, _ = await asyncio.to_thread(reader.communicate, timeout=READ_TIMEOUT)
    return digest, json.loads(out.strip().splitlines()[-1])


def test_another_uid_cannot_take_a_listed_stage_and_its_puts_stay_with_its_owner(
    users: dict[str, User], run_dir: str
) -> None:
    d = _daemon(users, run_dir)
    reader = subprocess.Popen(
        users[STAGE].argv(
            [sys.executable, "-m", "tests.adversarial._stage_reader", d.socket, "talker", KEY,
             "thinker"]
        ),
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    try:
        bound = _line(reader, BIND_TIMEOUT)
        assert "bound" in bound, bound

        # An admitted uid (a member of the daemon's group) declares the same stage.
        refused = run_as(users[SUPP], ["attach", d.socket, "talker"])
        assert refused.get("error") == "PermissionDeniedError", refused
        assert "stage 'talker'" in refused["message"], refused
        assert "--stage-owner" in refused["message"], refused
        assert metric(d.scrape(), "relayd_connections_refused_total", reason="stage_owner") == 1
        assert f"uid {users[SUPP].uid} may not serve stage 'talker'" in d.log()

        # The stage is still the owner's session's alone...
        status = d.status()
        assert [(s["stage"], s["session_id"]) for s in status["stages"]] == [
            ("talker", bound["bound"])
        ]
        assert {s["uid"] for s in status["sessions"]} == {users[STAGE].uid}
        # ... and a put to it reaches that reader, byte for byte.
        digest, read = asyncio.run(asyncio.wait_for(_put_to_talker(d.socket, reader), 120))
        assert read == {"sha256": digest}

        # The listed uid moves bytes as the stage, checked end to end.
        assert run_as(users[STAGE], ["attach", d.socket, "talker"]).get("ok") is True
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait(timeout=30)
        d.stop()


async def _round_trip(socket: str, stage: str) -> bool:
    data, digest = _payload()
    async with RelayClient(stage, socket, timeout=10) as c:
        ref = await c.put({"x": data}, to_stage=stage, request_id="root")
        back = await c.get(ref)
    return bool(hashlib.sha256(back["x"].numpy().tobytes()).hexdigest() == digest)


def test_stages_without_a_list_stay_open_and_root_may_serve_any(
    users: dict[str, User], run_dir: str
) -> None:
    d = _daemon(users, run_dir)
    try:
        for name in (STAGE, SUPP):
            answer = run_as(users[name], ["attach", d.socket, "thinker"])
            assert answer.get("ok") is True, (name, answer)
        # Root passes file permissions too: it may serve a listed stage.
        assert asyncio.run(asyncio.wait_for(_round_trip(d.socket, "talker"), 60))
        assert metric(d.scrape(), "relayd_connections_refused_total", reason="stage_owner") == 0
    finally:
        d.stop()
