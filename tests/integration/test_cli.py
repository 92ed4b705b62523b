import subprocess
import sys

import pytest

pytestmark = pytest.mark.cluster


def test_workbench_demo_is_a_headless_smoke_test(no_leftover_processes):
    proc = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "demo"], capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for task in ("ps:0", "worker:0", "worker:1"):
        assert f"{task}: sum(1..100) computed on the task = 5050" in out
    assert "task      engine  address" in out
    assert "stopped, nothing left running" in out
    assert "engines registered 3/3" in proc.stderr  # text progress in a terminal


def test_cli_errors_are_one_clear_line():
    proc = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "demo", "--workers", "0"], capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "workbench: error: workers=0 is not allowed: a cluster needs at least one worker: use workers=1 or more."
