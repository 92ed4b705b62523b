"""CPU time for the benchmarks: of a process by pid (``/proc``), of this process, and sampled while a run goes on."""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds(children: bool = False) -> float:
    """User + system CPU time of this process (and of its waited-for children, with ``children``)."""
    import resource

    who = [resource.RUSAGE_SELF, *([resource.RUSAGE_CHILDREN] if children else [])]
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, who))


class CpuSampler:
    """CPU seconds of groups of processes (``roles``: name -> pids) and of this process (``"client"``), sampled
    every ``SAMPLE_SECONDS`` while the ``with`` block runs; ``between(t0, t1)`` interpolates them at two host times
    (a steady-state window's ends)."""

    SAMPLE_SECONDS = 0.05

    def __init__(self, roles: dict[str, list[int]] | None = None):
        self.roles, self.samples = roles or {}, []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="bench-cpu-sampler")

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(5)

    def _sample(self) -> None:
        while not self._done.is_set():
            cpu = {role: sum(cpu_seconds(p) for p in pids) for role, pids in self.roles.items()}
            self.samples.append((time.time(), {**cpu, "client": own_cpu_seconds()}))
            self._done.wait(self.SAMPLE_SECONDS)

    def between(self, t0: float, t1: float) -> dict[str, float]:
        return between(self.samples, t0, t1)


def between(samples: list[tuple[float, dict]], t0: float, t1: float) -> dict[str, float]:
    """Each sampled counter's growth from host time ``t0`` to ``t1``."""
    return {role: _at(samples, t1, role) - _at(samples, t0, role) for role in samples[0][1]}


def _at(samples: list[tuple[float, dict]], t: float, role: str) -> float:
    """A sampled counter at time ``t``, linear between the samples around it."""
    times = [s[0] for s in samples]
    i = min(max(bisect.bisect_left(times, t), 1), len(samples) - 1)
    (ta, a), (tb, b) = samples[i - 1], samples[i]
    return a[role] + (b[role] - a[role]) * min(max((t - ta) / (tb - ta), 0.0), 1.0) if tb > ta else b[role]
