"""tests/stuck_tests.py, the suite's watchdog, run on a test that pytest-timeout cannot interrupt."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent

STUCK = '''
import signal
import subprocess


def test_stuck():
    # SIGALRM blocked: pytest-timeout's alarm never arrives, as for a test blocked inside one C call
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    child = subprocess.Popen(["sleep", "600"])
    assert child.wait() == 0


def test_after():
    assert True
'''


def test_a_test_stuck_out_of_pytest_timeouts_reach_is_named_its_processes_ended_and_the_suite_goes_on(tmp_path):
    (tmp_path / "test_stuck.py").write_text(STUCK)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 2\n")
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "WORKBENCH_TEST_PHASE_LIMITS": "call=4"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "stuck_tests", "-p", "no:cacheprovider",
                             "-q", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert "WATCHDOG: test_stuck.py::test_stuck (call) has run" in output, output
    assert "in test_stuck" in output, output  # the stack of the stuck test
    assert "sleep" in output and "WATCHDOG: stuck: test_stuck.py::test_stuck (call)" in output, output
    assert "1 failed, 1 passed" in output, output  # the stuck test failed once its child was ended; the next ran
    assert result.returncode == 1, output
