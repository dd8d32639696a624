"""The worker zygote (tests/_zygote.py) behaves as a fresh child process would."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests import _zygote
from tests._daemon import REPO, read_line, send_line

BOUND = 30.0


def _echo() -> subprocess.Popen[bytes]:
    return _zygote.popen("tests._echo_worker", [], cwd=REPO)


def test_a_worker_talks_over_its_pipes_and_its_exit_code_comes_back() -> None:
    with _echo() as proc:
        assert proc.pid != os.getpid()
        send_line(proc, "echo hello")
        assert read_line(proc, BOUND) == "hello"
        assert proc.poll() is None
        send_line(proc, "exit 7")
        assert proc.wait(timeout=BOUND) == 7
    assert proc.returncode == 7


def test_a_killed_worker_reports_the_signal_and_wait_times_out_before() -> None:
    with _echo() as proc:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.05)
        proc.kill()
        assert proc.wait(timeout=BOUND) == -signal.SIGKILL
        proc.kill()  # a no-op once it is reaped, as for any Popen


def test_a_worker_sees_the_environment_of_the_moment_it_was_forked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RELAYD_ZYGOTE_PROBE", "now")
    with _echo() as proc:
        out, err = proc.communicate(b"env RELAYD_ZYGOTE_PROBE\nstderr oops\n", timeout=BOUND)
    assert (out, err, proc.returncode) == (b"now\n", b"oops\n", 0)


def test_run_captures_output_and_the_exit_code() -> None:
    cp = _zygote.run("tests._echo_worker", [], cwd=REPO, input=b"echo x\nexit 3\n", timeout=BOUND)
    assert (cp.stdout, cp.stderr, cp.returncode) == (b"x\n", b"", 3)


def test_a_reused_pid_is_not_taken_for_exited_with_its_predecessors_code() -> None:
    ledger = _zygote._Ledger()
    ledger.record({"exit": 4242, "code": -signal.SIGKILL})  # an earlier worker's
    ledger.record({"pid": 4242})  # pids wrapped: a new worker has its pid
    assert ledger.pids == [4242] and 4242 not in ledger.exits
    ledger.record({"exit": 4242, "code": 0})
    assert ledger.exits[4242] == 0
