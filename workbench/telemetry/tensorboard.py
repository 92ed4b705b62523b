"""What a distributed job adds to a TensorBoard log dir: one run per task, with what only such a job has.

Keras's ``TensorBoard`` callback writes the ``train`` and ``validation`` runs (loss, metrics, learning
rate) as it does for ``model.fit``. Beside them, ``JobSummaries`` writes one run per task
(``worker-0``, ``worker-1``, ..., and a ps or other task when something happened to it), from the
job's step records as the kernel receives them:

* ``workbench/examples_per_second`` and ``workbench/step_time_seconds`` of each worker, over the steps
  that came back since its last point (a point a second, and one at each epoch's end), at the newest step;
* at each epoch's end: ``workbench/staleness`` (async-ps: updates other workers applied between a
  step's read of the parameters and its own update, from the workers' timestamps, mean per step),
  ``workbench/dropped_gradients`` (sync-ps: the worker's gradients left out of its epoch's steps),
  ``workbench/bytes_per_step`` (ps strategies: parameters in and gradients out, per step of a worker);
* ``workbench/faults``: each task lost, hung or straggling, and what was done, as a text event.

The x axis is the job's global step. The pure functions compute; ``JobSummaries`` only writes.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict
from pathlib import Path

LOCAL_DEVICE = "/job:localhost/replica:0/task:0/device:CPU:0"  # the kernel's own CPU, connected to a cluster or not
POINT_SECONDS = 1.0  # a worker's rates are written at most this often (each write costs the kernel CPU the tasks want)


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


def staleness(records: list[dict]) -> dict[str, float]:
    """async-ps, per worker: the mean number of other workers' updates that landed while a step of its own ran
    (between its read of the parameters, ``start``, and its update, ``end``), from the step records."""
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
    return {worker: sum(values) / len(values) for worker, values in counts.items()}


def dropped_gradients(records: list[dict], workers: list[str]) -> dict[str, int]:
    """sync-ps, per worker: the steps its gradient was not among the ones applied (late, or left out)."""
    return {worker: sum(1 for r in records if worker not in contributors(r)) for worker in workers}


def run_name(task: str) -> str:
    """The TensorBoard run (a directory) of a task: ``worker:0`` -> ``worker-0``."""
    return task.replace(":", "-").replace("/", "-")


class JobSummaries:
    """The per-task runs of one job under ``log_dir`` (see the module's docstring)."""

    def __init__(self, log_dir: str | Path):
        from ..optional import require

        require("tensorboard", "TensorBoard logs (a keras.callbacks.TensorBoard callback)")
        self.log_dir = Path(log_dir)
        self._writers: dict = {}
        self.workers: list[str] = []
        self._pending: list[dict] = []  # step records not written yet
        self._written_at = time.monotonic()

    def _write(self, task: str, step: int, scalars: dict[str, float] | None = None, text: str | None = None) -> None:
        import tensorflow as tf

        with tf.device(LOCAL_DEVICE):
            writer = self._writers.get(task)
            if writer is None:
                writer = self._writers[task] = tf.summary.create_file_writer(str(self.log_dir / run_name(task)))
            with writer.as_default(step=int(step)):
                for tag, value in (scalars or {}).items():
                    tf.summary.scalar(f"workbench/{tag}", float(value))
                if text is not None:
                    tf.summary.text("workbench/faults", text)

    def steps(self, records: list[dict], now: bool = False) -> None:
        """Steps that came back: each worker's examples/s and step time over those since the last point, written
        once ``POINT_SECONDS`` passed since then (or ``now``)."""
        self._pending.extend(records)
        if not self._pending or (not now and time.monotonic() - self._written_at < POINT_SECONDS):
            return
        records, self._pending, self._written_at = self._pending, [], time.monotonic()
        step = max(r["step"] for r in records) + 1
        for worker, rates in sorted(worker_rates(records).items()):
            if worker not in self.workers:
                self.workers.append(worker)
            self._write(worker, step, rates)

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
        for worker, scalars in values.items():
            if scalars:
                self._write(worker, step, scalars)

    def fault(self, fault: dict, step: int) -> None:
        """A task lost, hung or straggling, and what was done about it: a text event in the task's run."""
        line = f"{fault.get('kind')}: {fault.get('action')}"
        detail = fault.get("detail")
        self._write(fault.get("task") or "job", step, text=f"{line} ({detail})" if detail else line)

    def close(self) -> None:
        self.steps([], now=True)
        for writer in self._writers.values():
            writer.flush()
            writer.close()
        self._writers = {}
