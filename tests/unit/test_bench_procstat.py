"""The bench's procfs sampling of another process: CPU and event-loop wake-ups."""

from __future__ import annotations

import os
import select
import subprocess
import sys

from relayd_bench._procstat import ProcSample, proc_cpu_ns, proc_sample, proc_wakeups


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


def test_another_process_cpu_is_read_to_the_microsecond() -> None:
    """Far finer than /proc's 10 ms tick: a child's ~2 ms of work shows as such,
    and its time asleep adds nothing."""
    code = (
        "import sys, time\n"
        "end = time.thread_time() + 0.002\n"
        "while time.thread_time() < end: pass\n"
        "print('spun', flush=True)\n"
        "sys.stdin.read()\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline() == "spun\n"
        first = proc_cpu_ns(child.pid)
        assert first is not None and first % 10_000_000 != 0  # not whole ticks
        again = proc_cpu_ns(child.pid)  # the child sleeps on its stdin meanwhile
        assert again is not None and 0 <= again - first < 1_000_000
        child.stdin.close()
        child.wait(timeout=30)
    assert proc_cpu_ns(child.pid) is None
