"""The bench's procfs sampling of another process: CPU and event-loop wake-ups."""

from __future__ import annotations

import os
import select
import subprocess
import sys

from relayd_bench._procstat import ProcSample, proc_sample, proc_wakeups


def test_each_sleep_of_the_main_thread_counts_as_one_wakeup() -> None:
    before = proc_sample(os.getpid())
    assert before is not None
    for _ in range(5):
        select.select([], [], [], 0.001)  # blocks: the thread sleeps, then is woken
    after = proc_sample(os.getpid())
    assert after is not None
    delta = after - before
    assert delta.wakeups >= 5
    assert delta.cpu_ns >= 0


def test_a_process_that_is_gone_has_no_sample() -> None:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    pid = int(child.stdout)
    assert proc_wakeups(pid) is None
    assert proc_sample(pid) is None


def test_samples_subtract_field_by_field() -> None:
    assert ProcSample(50, 7) - ProcSample(20, 3) == ProcSample(30, 4)
