"""The whole suite as two pytest processes side by side, then one alone: what ``make test`` runs.

The suite mostly waits (on Slurm and sshd, on browsers and Jupyter servers, on training steps and their
remote calls): one pytest process kept this 2-core machine about a third busy. So it runs as two halves:

- ``environment``: the tests that need the machine's environment: the browser, the Binder environment
  and the tutorials run in it, network namespaces, emulated hosts over SSH, Slurm, MPI (the Debian
  packages some of them install on the fly are installed by this half alone), engines that
  ipyparallel's own launcher starts as new processes (a user's pool borrowed), and engines whose
  environment fails them (no TensorFlow, another version, a death at start) or whose client is killed;
- ``core``: everything else: clusters, training, recovery, the server, the unit tests (the two halves take
  about as long: each test file is in the half that evens them out, judged by its CPU-seconds in
  ``test-artifacts/cpu-<part>.tsv``);

then, alone, ``quiet``: the tests whose assertions bound how long the process may go without running
Python (``test_job_queue.py``'s watchdog). Beside the other half they measured stalls three times as long
(1.0 and 1.7 s, against 0.14 to 0.59 s alone), TensorFlow holding the GIL through RPCs to busier tasks.

The halves share nothing they could trip over: each pytest process has its own registry directory, its own
session clusters (named with its pid) and its own warm process; their namespaces and links are named with
their pid. Both halves get the given pytest arguments. Each line either half prints is printed as it
comes, prefixed with its part's name; each part's whole output is kept in ``test-artifacts/pytest-<part>.log``
and its JUnit report in ``test-artifacts/junit-<part>.xml``; the last lines name every failed test of every
part, read from those reports (or, for a part a signal ended, which signal and where its log stopped), so that a
log cut to its tail still says what failed. As root, each part runs in a CPU-accounting cgroup of its own and
``test-artifacts/cpu-<part>.tsv`` says what each test and each file cost in CPU-seconds, everything it started
included (``tests/cpu_accounting.py``): on two cores that, more than wall
time, is what one test takes from the others. Given test paths, one pytest runs just those.

    python tests/run_suite.py [pytest arguments...]

Exit status: 0 when every part passed (a part that selected no test counts as passed, unless all did).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
ENVIRONMENT = [
    "tests/browser",
    *(f"tests/integration/test_{name}.py" for name in ("tutorials", "exposure", "hosts", "network", "mpi", "slurm", "ssh",
                                                        "existing_and_gpus", "failures")),
]
QUIET = ["tests/integration/test_job_queue.py"]
CPUACCT = Path("/sys/fs/cgroup/cpuacct")
SUITE_LIMIT = 90 * 60  # seconds: CI's limit; pytest-timeout bounds each test far below it
STOP_GRACE = 120  # seconds each half gets to stop its processes after an interrupt
NO_TESTS = 5  # pytest's exit status when a selection is empty
INTERRUPTED = 2  # pytest's exit status when interrupted (Ctrl-C): the quiet part is not started then
LOG_LINES_SHOWN = 12  # of a part's log, after it ended by a signal: its test files' progress lines say where


def halves() -> dict[str, list[str]]:
    """Each half's pytest arguments that choose its tests."""
    return {"environment": list(ENVIRONMENT), "core": ["tests", *(f"--ignore={path}" for path in [*ENVIRONMENT, *QUIET])]}


def _forward(name: str, stream, log) -> None:
    for line in stream:
        log.write(line)
        log.flush()
        sys.stdout.write(f"[{name}] {line}")
        sys.stdout.flush()


def _cgroup_path(name: str) -> Path:
    return CPUACCT / f"workbench-suite-{os.getpid()}-{name}"


def _accounting_cgroup(name: str) -> Path | None:
    """A new cpuacct cgroup for one part (as root, with cgroup v1's cpuacct), else None."""
    if os.geteuid() != 0 or not (CPUACCT / "cgroup.procs").exists():
        return None
    cgroup = _cgroup_path(name)
    try:
        cgroup.mkdir(exist_ok=True)
    except OSError:
        return None
    return cgroup


def _start(name: str, selection: list[str], args: list[str]) -> tuple[subprocess.Popen, threading.Thread, object]:
    log = (ARTIFACTS / f"pytest-{name}.log").open("w")
    for stale in (f"junit-{name}.xml", f"cpu-{name}.tsv"):  # no earlier run's report read as this one's
        (ARTIFACTS / stale).unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", *selection, f"--junitxml={ARTIFACTS / f'junit-{name}.xml'}", *args]
    cgroup = _accounting_cgroup(name)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WORKBENCH_TEST_CPU_REPORT": str(ARTIFACTS / f"cpu-{name}.tsv")}

    def join_cgroup() -> None:  # in the child, before pytest: it and everything it starts are counted there
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, env=env, preexec_fn=join_cgroup)
    reader = threading.Thread(target=_forward, args=(name, proc.stdout, log), daemon=True, name=f"suite-{name}")
    reader.start()
    return proc, reader, log


def _wait(procs: dict[str, subprocess.Popen], deadline: float) -> None:
    while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
        time.sleep(0.5)


def _stop(procs: dict[str, subprocess.Popen], why: str) -> None:
    """Interrupt the halves still running (each stops what its tests started), and kill those that do not end."""
    print(f"\nrun_suite: {why}; stopping the halves still running", flush=True)
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    _wait(procs, time.monotonic() + STOP_GRACE)
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def main(args: list[str]) -> int:
    if any(not arg.startswith("-") and Path(ROOT, arg.split("::")[0]).exists() for arg in args):
        return subprocess.call([sys.executable, "-m", "pytest", *args], cwd=ROOT)  # the tests asked for, in one run
    ARTIFACTS.mkdir(exist_ok=True)
    started = time.monotonic()
    codes = _run_together(halves(), args, started)
    if INTERRUPTED not in codes.values():
        codes.update(_run_together({"quiet": list(QUIET)}, args, started))
    minutes, seconds = divmod(round(time.monotonic() - started), 60)
    for line in failures(codes):
        print(line, flush=True)
    print(f"\nrun_suite: {', '.join(f'{name} exit status {code}' for name, code in codes.items())} "
          f"in {minutes:.0f} min {seconds:.0f} s (logs: test-artifacts/pytest-<part>.log)", flush=True)
    if all(code == NO_TESTS for code in codes.values()):
        return NO_TESTS
    return 0 if all(code in (0, NO_TESTS) for code in codes.values()) else 1


def failures(codes: dict[str, int], artifacts: Path = ARTIFACTS) -> list[str]:
    """Every failed or erred test of these parts (name -> exit status), one line each, read from their JUnit
    reports: the end of the output names them all, whichever part printed them first (a CI log often keeps only
    its last lines). A part ended by a signal wrote no report: its signal and its log's last lines instead."""
    lines = []
    for name, code in codes.items():
        if code is not None and code < 0:
            lines.extend(_ended_by_signal(name, -code, artifacts / f"pytest-{name}.log"))
        report = artifacts / f"junit-{name}.xml"
        if not report.exists():
            continue
        for case in ElementTree.parse(report).iter("testcase"):
            for problem in (*case.iter("failure"), *case.iter("error")):
                said = [line.strip() for line in (problem.get("message") or "").splitlines() if line.strip()]
                # its first lines say where, its last what (a failed notebook cell's message ends with its error)
                shown = said if len(said) <= 5 else [*said[:3], "...", *said[-2:]]
                lines.append(f"run_suite: [{name}] {problem.tag.upper()} {case.get('classname')}::{case.get('name')}"
                             f" - {' / '.join(shown)[:500]}")
    return lines


def _ended_by_signal(name: str, number: int, log: Path, shown: int = LOG_LINES_SHOWN) -> list[str]:
    """What a part killed by a signal leaves to say: which signal, and where its log stopped (the file it was in)."""
    try:
        signal_name = signal.Signals(number).name
    except ValueError:
        signal_name = f"signal {number}"
    try:
        tail = log.read_text(errors="replace").splitlines()[-shown:]
    except OSError:
        tail = ["(no log)"]
    return [f"run_suite: [{name}] ENDED BY {signal_name} before it wrote its report; the last lines of {log.name}:",
            *(f"run_suite: [{name}]   {line}" for line in tail)]


def _run_together(parts: dict[str, list[str]], args: list[str], started: float) -> dict[str, int]:
    """Run these parts side by side; their exit statuses."""
    running = {name: _start(name, selection, args) for name, selection in parts.items()}
    procs = {name: proc for name, (proc, _reader, _log) in running.items()}
    try:
        _wait(procs, started + SUITE_LIMIT)
        if any(p.poll() is None for p in procs.values()):
            _stop(procs, f"the suite ran past {SUITE_LIMIT // 60} minutes")
    except KeyboardInterrupt:
        _stop(procs, "interrupted")
        raise
    finally:
        for _proc, reader, log in running.values():
            reader.join(30)
            log.close()
        for name in parts:
            _close_cgroup(name)
    return {name: proc.returncode for name, proc in procs.items()}


def _close_cgroup(name: str) -> None:
    """Say what a part cost in CPU-seconds, and remove its cgroup (left if a process of it still runs)."""
    cgroup = _cgroup_path(name)
    if not cgroup.exists():
        return
    try:
        used = int((cgroup / "cpuacct.usage").read_text()) / 1e9
        print(f"run_suite: {name} used {used:,.0f} CPU-seconds (each test's: test-artifacts/cpu-{name}.tsv)",
              flush=True)
        cgroup.rmdir()
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
