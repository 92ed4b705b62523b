"""tests/stacks.py: a stuck process's stacks, read with py-spy, for a failure report."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import stacks
from conftest import read_line

BUSY = """
import threading, time
threading.Thread(target=lambda: time.sleep(60), name="sleeper", daemon=True).start()
def spin_in_here():
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        sum(range(1000))
print("ready", flush=True)
spin_in_here()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="py-spy reads another process's memory with ptrace: run as root (CI does)")
def test_a_busy_process_shows_its_main_threads_innermost_frames_and_not_its_idle_ones():
    process = subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.PIPE, text=True)
    try:
        assert read_line(process, 60, "ready").strip() == "ready"
        time.sleep(0.3)
        glance, full = stacks.report([process.pid], what="spinner")
    finally:
        process.kill()
        process.wait(timeout=10)
    assert glance.startswith(f"spinner {process.pid}: {process.pid} \"MainThread\" active"), glance
    assert "spin_in_here < <module>" in glance, glance
    assert "sleeper" not in glance, glance  # idle threads are in the whole dump only
    assert '"sleeper"' in full and f"--- spinner {process.pid} ---" in full, full


def test_a_dump_of_a_process_that_is_gone_says_so():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait(timeout=30)
    assert stacks.dump(process.pid).startswith("(no stacks: ")
    assert stacks.report([], what="kernel") == ("no kernel process found", "")
