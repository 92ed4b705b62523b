"""What only a distributed job has, per task, from its step records: for TensorBoard and experiment trackers.

``JobScalars`` computes, from the job's step records as the kernel receives them, and hands each figure to
its sinks (``TensorBoardSink``, ``wb.tracking``'s callbacks: anything with ``log_scalars`` and ``log_text``):

* ``examples_per_second`` and ``step_time_seconds`` of each worker, over the steps that came back since its
  last point (a point a second, and one at each epoch's end), at the newest step;
* at each epoch's end: ``staleness`` (async-ps: updates other workers applied between a step's read of the
  parameters and its own update, from the workers' timestamps, mean per step), ``dropped_gradients``
  (sync-ps: the worker's gradients left out of its epoch's steps), ``bytes_per_step`` (ps strategies:
  parameters in and gradients out, per step of a worker);
* events, as a line of text: ``faults``, each task lost, hung or straggling and what was done (in that task's
  series); ``scales``, each change of the job's workers (in the ``job`` series).

The step is the job's global step. The pure functions compute; the sinks only write.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict
from typing import Protocol

POINT_SECONDS = 1.0  # a worker's rates are written at most this often (each write costs the kernel CPU the tasks want)


class ScalarSink(Protocol):
    """Where a job's per-task figures go: a TensorBoard log dir, an experiment tracker's run."""

    def log_scalars(self, task: str, step: int, values: dict[str, float]) -> None: ...

    def log_text(self, task: str, step: int, kind: str, text: str) -> None: ...


def contributors(record: dict) -> list[str]:
    return record["worker"].split(",")


def worker_rates(records: list[dict]) -> dict[str, dict[str, float]]:
    """Per worker: examples/s and mean seconds per step over ``records`` (a step of several workers counts
    for each, with its share of the examples)."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for record in records:
        names = contributors(record)
        seconds = max(float(record["end"]) - float(record["start"]), 1e-9)
        for name in names:
            total = sums[name]
            total[0] += record["examples"] / len(names)
            total[1] += seconds
            total[2] += 1
    return {name: {"examples_per_second": examples / seconds, "step_time_seconds": seconds / steps}
            for name, (examples, seconds, steps) in sums.items()}


def step_staleness(records: list[dict]) -> dict[str, list[int]]:
    """async-ps, per worker and in the records' order: for each step of its own, how many of the other workers'
    updates landed while it ran (between its read of the parameters, ``start``, and its update, ``end``)."""
    ends: dict[str, list[float]] = defaultdict(list)
    for record in records:
        ends[record["worker"]].append(float(record["end"]))
    for values in ends.values():
        values.sort()
    counts: dict[str, list[int]] = defaultdict(list)
    for record in records:
        start, end = float(record["start"]), float(record["end"])
        counts[record["worker"]].append(sum(bisect.bisect_right(values, end) - bisect.bisect_right(values, start)
                                            for worker, values in ends.items() if worker != record["worker"]))
    return dict(counts)


def staleness(records: list[dict]) -> dict[str, float]:
    """async-ps, per worker: the mean of ``step_staleness`` over its steps."""
    return {worker: sum(values) / len(values) for worker, values in step_staleness(records).items()}


def dropped_gradients(records: list[dict], workers: list[str]) -> dict[str, int]:
    """sync-ps, per worker: the steps its gradient was not among the ones applied (late, or left out)."""
    return {worker: sum(1 for r in records if worker not in contributors(r)) for worker in workers}


def fault_line(fault: dict) -> str:
    """A task lost, hung or straggling, and what was done about it, in one line."""
    line = f"{fault.get('kind')}: {fault.get('action')}"
    detail = fault.get("detail")
    return f"{line} ({detail})" if detail else line


def scale_line(event: dict) -> str:
    """A change of the job's workers (``job.events``), in one line."""
    changes = "; ".join(f"{what}: {', '.join(event[what])}" for what in ("joined", "left") if event.get(what))
    return (f"scale to {len(event['workers'])} worker(s) ({changes}); drained {event['drain_seconds']:.1f} s, "
            f"paused {event['pause_seconds']:.1f} s")


class JobScalars:
    """One job's per-task figures, computed once and handed to every sink (see the module's docstring)."""

    def __init__(self, sinks: list[ScalarSink]):
        self.sinks = list(sinks)
        self.workers: list[str] = []
        self._pending: list[dict] = []  # step records not handed on yet
        self._written_at = time.monotonic()

    def _scalars(self, task: str, step: int, values: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log_scalars(task, int(step), values)

    def _text(self, task: str, step: int, kind: str, text: str) -> None:
        for sink in self.sinks:
            sink.log_text(task, int(step), kind, text)

    def steps(self, records: list[dict], now: bool = False) -> None:
        """Steps that came back: each worker's examples/s and step time over those since the last point, handed on
        once ``POINT_SECONDS`` passed since then (or ``now``)."""
        self._pending.extend(records)
        if not self._pending or (not now and time.monotonic() - self._written_at < POINT_SECONDS):
            return
        records, self._pending, self._written_at = self._pending, [], time.monotonic()
        step = max(r["step"] for r in records) + 1
        for worker, rates in sorted(worker_rates(records).items()):
            if worker not in self.workers:
                self.workers.append(worker)
            self._scalars(worker, step, rates)

    def epoch(self, records: list[dict], scalars: tuple[str, ...], bytes_per_step: dict | None, step: int) -> None:
        """What an epoch's records say per worker: bytes per step, and those of ``scalars`` the job's strategy has
        (``"staleness"``: async-ps; ``"dropped_gradients"``: sync-ps)."""
        self.steps([], now=True)
        workers = sorted({w for r in records for w in contributors(r)} | set(self.workers))
        values: dict[str, dict[str, float]] = {w: {} for w in workers}
        if "staleness" in scalars:
            for worker, mean in staleness(records).items():
                values[worker]["staleness"] = mean
        if "dropped_gradients" in scalars:
            for worker, count in dropped_gradients(records, workers).items():
                values[worker]["dropped_gradients"] = count
        if bytes_per_step:
            for worker in workers:
                values[worker]["bytes_per_step"] = bytes_per_step["total"]
        for worker, figures in values.items():
            if figures:
                self._scalars(worker, step, figures)

    def fault(self, fault: dict, step: int) -> None:
        self._text(fault.get("task") or "job", step, "faults", fault_line(fault))

    def scale(self, event: dict) -> None:
        self._text("job", event["step"], "scales", scale_line(event))
