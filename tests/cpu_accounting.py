"""Each test's CPU time, with everything it started, when the suite runs in a CPU-accounting cgroup of its own.

The suite is bound by this machine's two cores, not by waiting: a test's wall time says little about what it
costs the tests beside it, its CPU time does. ``tests/run_suite.py`` (as root, with cgroup v1's ``cpuacct``)
starts each part's pytest in a cgroup of its own; every process a test starts (engines, controllers, kernels,
Jupyter servers, Chromium, sshd, Slurm) stays in it whatever its parent, so the cgroup's counter read before
and after each test says what that test cost. Module and session fixtures count in the test that set them up.

The report, ``test-artifacts/cpu-<part>.tsv``: one line a test (its id, wall seconds, CPU seconds), then one
line a file, costliest first. Nothing is written when the process is not in a cgroup of its own.

A part run by pytest-xdist workers: each worker moves into a cgroup of its own inside the part's (named after the
worker: ``gw0``...), so that a test's counter holds only what its worker ran; each writes its lines beside the
report (``cpu-<part>-gw0.tsv``...), and the controller joins them into the part's report once they are done.
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
WORKER_ENV = "PYTEST_XDIST_WORKER"  # set by pytest-xdist in each of its workers: gw0, gw1...


def pytest_configure(config) -> None:
    global _accounts
    report, cgroup, worker = os.environ.get(REPORT_ENV), own_cgroup(), os.environ.get(WORKER_ENV)
    if not report or cgroup is None:
        return
    if worker:
        cgroup = _worker_cgroup(cgroup, worker)
        if cgroup is None:
            return
        report = str(_worker_report(Path(report), worker))
    _accounts = _Accounts(cgroup, Path(report))


def _worker_cgroup(part: Path, worker: str) -> Path | None:
    """A cgroup for this worker inside its part's, this process moved into it (None where that is refused)."""
    own = part / worker
    try:
        own.mkdir(exist_ok=True)
        (own / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return None
    return own


def _worker_report(report: Path, worker: str) -> Path:
    return report.with_name(f"{report.stem}-{worker}{report.suffix}")


def _rows(report: Path) -> list[tuple[str, float, float]]:
    """A report's test lines."""
    rows = []
    for line in report.read_text().splitlines()[1:]:
        if not line:
            break
        nodeid, wall, cpu = line.split("\t")
        rows.append((nodeid, float(wall), float(cpu)))
    return rows


def _join_workers(report: Path, cgroup: Path) -> None:
    """The controller: the workers' reports joined into the part's, and their cgroups removed (as they end)."""
    joined = _Accounts(cgroup, report)
    for part in sorted(report.parent.glob(f"{report.stem}-gw*{report.suffix}")):
        joined.rows.extend(_rows(part))
        part.unlink()
    if joined.rows:
        joined.write()
    for child in cgroup.glob("gw*"):
        try:
            child.rmdir()
        except OSError:  # a process of it still runs: the part's cgroup is left too, run_suite says so
            pass


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
    report, cgroup = os.environ.get(REPORT_ENV), own_cgroup()
    if report and cgroup is not None and not os.environ.get(WORKER_ENV) and getattr(config, "workerinput", None) is None:
        _join_workers(Path(report), cgroup)
