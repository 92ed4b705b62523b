"""Each test's CPU time, with everything it started, when the suite runs in a CPU-accounting cgroup of its own.

The suite is bound by this machine's two cores, not by waiting: a test's wall time says little about what it
costs the tests beside it, its CPU time does. ``tests/run_suite.py`` (as root, with cgroup v1's ``cpuacct``)
starts each part's pytest in a cgroup of its own; every process a test starts (engines, controllers, kernels,
Jupyter servers, Chromium, sshd, Slurm) stays in it whatever its parent, so the cgroup's counter read before
and after each test says what that test cost. Module and session fixtures count in the test that set them up.

The report, ``test-artifacts/cpu-<part>.tsv``: one line a test (its id, wall seconds, CPU seconds), then one
line a file, costliest first. Nothing is written when the process is not in a cgroup of its own.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
REPORT_ENV = "WORKBENCH_TEST_CPU_REPORT"  # the report's path, set by tests/run_suite.py


def own_cgroup() -> Path | None:
    """This process's cpuacct cgroup, when it is not the root one."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _id, controllers, path = line.split(":", 2)
        if "cpuacct" in controllers.split(",") and path != "/":
            found = CPUACCT / path.lstrip("/")
            return found if (found / "cpuacct.usage").exists() else None
    return None


class _Accounts:
    def __init__(self, cgroup: Path, report: Path) -> None:
        self.usage = cgroup / "cpuacct.usage"
        self.report = report
        self.rows: list[tuple[str, float, float]] = []

    def read(self) -> float:
        return int(self.usage.read_text()) / 1e9

    def write(self) -> None:
        by_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for nodeid, wall, cpu in self.rows:
            totals = by_file[nodeid.split("::")[0]]
            totals[0] += wall
            totals[1] += cpu
        lines = ["test\twall_s\tcpu_s", *(f"{n}\t{w:.1f}\t{c:.1f}" for n, w, c in self.rows), "",
                 "file\twall_s\tcpu_s",
                 *(f"{n}\t{w:.1f}\t{c:.1f}" for n, (w, c) in sorted(by_file.items(), key=lambda kv: -kv[1][1]))]
        self.report.write_text("\n".join(lines) + "\n")


_accounts: _Accounts | None = None


def pytest_configure(config) -> None:
    global _accounts
    report, cgroup = os.environ.get(REPORT_ENV), own_cgroup()
    if report and cgroup is not None:
        _accounts = _Accounts(cgroup, Path(report))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _accounts is None:
        yield
        return
    wall, cpu = time.monotonic(), _accounts.read()
    yield
    _accounts.rows.append((item.nodeid, time.monotonic() - wall, _accounts.read() - cpu))


def pytest_unconfigure(config) -> None:
    if _accounts is not None and _accounts.rows:
        _accounts.write()
