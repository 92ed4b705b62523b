"""What a stuck process of a test is doing: its threads' Python stacks, read from outside with py-spy.

A kernel that runs no cell for minutes answers nothing (not even a control request when one of its
threads holds the GIL), so only a reader from outside can say where it waits. py-spy reads the stacks
of another process (ptrace: root, or a kernel.yama.ptrace_scope that allows it) without stopping it for
long. A failure report puts the innermost frames of each busy thread first, the whole dump after.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import psutil

DUMP_TIMEOUT = 30.0


def _py_spy() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")  # the suite's environment, whether or not it is on PATH
    return str(beside) if beside.exists() else shutil.which("py-spy")


def dump(pid: int) -> str:
    """The text of ``py-spy dump`` for ``pid`` (every thread, innermost frame first), or why there is none."""
    tool = _py_spy()
    if tool is None:
        return "(no stacks: py-spy is not installed in the test environment)"
    command = [tool, "dump", "--pid", str(pid)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DUMP_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        return f"(no stacks: py-spy did not read process {pid} within {DUMP_TIMEOUT:.0f} s)"
    return done.stdout.strip() or f"(no stacks: py-spy said {done.stderr.strip()[:300]!r})"


def innermost(text: str, frames: int = 3) -> str:
    """One line of a ``dump``: each thread that is not idle (and the main one), with its ``frames`` innermost
    frames' functions, innermost first."""
    threads: list[tuple[str, list[str]]] = []
    shown = False
    for line in text.splitlines():
        if line.startswith("Thread "):
            shown = "(idle)" not in line or '"MainThread"' in line
            if shown:
                threads.append((line.split(" (")[0].removeprefix("Thread ") + _state(line), []))
        elif shown and line.startswith("    ") and len(threads[-1][1]) < frames:
            threads[-1][1].append(line.strip().split(" (")[0])
    return "; ".join(f"{name}: {' < '.join(calls)}" for name, calls in threads)


def _state(header: str) -> str:
    """``Thread 12 (active+gil): "MainThread"`` → `` "MainThread" active+gil``."""
    name = header.rsplit(":", 1)[-1].strip() if header.count(":") else ""
    state = header.split("(", 1)[-1].split(")", 1)[0] if "(" in header else ""
    return f" {name} {state}".rstrip()


def kernels_of(root_pid: int) -> list[int]:
    """The ipykernel processes below ``root_pid`` (a Jupyter server) now."""
    try:
        below = psutil.Process(root_pid).children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for process in below:
        try:
            if any("ipykernel" in part for part in process.cmdline()):
                found.append(process.pid)
        except psutil.Error:
            continue
    return found


def report(pids: list[int], what: str = "kernel") -> tuple[str, str]:
    """(one line: each process's threads at a glance, the whole dumps) for a failure message."""
    if not pids:
        return f"no {what} process found", ""
    dumps = {pid: dump(pid) for pid in pids}
    glance = " | ".join(f"{what} {pid}: {innermost(text)}" for pid, text in dumps.items())
    return glance, "\n\n".join(f"--- {what} {pid} ---\n{text}" for pid, text in dumps.items())
