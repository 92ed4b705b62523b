"""Event records -> plot data. Pure functions (no Bokeh), so each is tested on its own.

Times in plot columns are milliseconds since the epoch: what Bokeh's datetime axes use.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..cluster.jobs import ENDED, FINISHED, QUEUED
from ..telemetry.events import COMPUTE, PHASES, JobProgress, LinkEvent, StepDone, StepSpan, TaskEvent

TOTAL = "total"
SPAN_COLUMNS = ("row", "left", "right", "phase", "task", "step", "steps", "duration_ms", "examples", "job")


def row_name(device: str) -> str:
    """``/job:worker/replica:0/task:0/device:CPU:0`` -> ``/job:worker/task:0/device:CPU:0`` (shorter, still exact)."""
    return device.replace("/replica:0", "")


def device_rows(tasks: Iterable) -> list[str]:
    """Timeline rows: every CPU and GPU device of every task, ps tasks first (``cluster.tasks`` order)."""
    rows = []
    for record in tasks:
        devices = [d for d in record.devices if "/device:CPU:" in d or "/device:GPU:" in d]
        for device in devices or [f"{record.task.device}/device:CPU:0"]:
            if row_name(device) not in rows:
                rows.append(row_name(device))
    return rows


def span_columns(spans: Iterable[StepSpan], now: float | None = None) -> dict[str, list]:
    """Step spans -> timeline columns. An in-progress span (``end`` None) reaches to ``now``."""
    columns: dict[str, list] = {name: [] for name in SPAN_COLUMNS}
    for span in spans:
        end = span.end if span.end is not None else max(now or span.start, span.start)
        columns["row"].append(row_name(span.device))
        columns["left"].append(span.start * 1000.0)
        columns["right"].append(end * 1000.0)
        columns["phase"].append(span.phase)
        columns["task"].append(span.task)
        columns["step"].append(span.step)
        columns["steps"].append(span.steps)
        columns["duration_ms"].append((end - span.start) * 1000.0)
        columns["examples"].append(span.examples)
        columns["job"].append(span.job)
    return columns


OVERVIEW_COLUMNS = ("row", "left", "right", "phase", "alpha", "busy_ms", "bars")


def overview_columns(columns: dict[str, list], start: float, end: float, bucket_ms: float) -> dict[str, list]:
    """Timeline bars narrower than a pixel, drawn as what they add up to (the timeline zoomed out on many steps).

    Per row and bucket of ``bucket_ms`` between ``start`` and ``end`` (ms): one bar over the bucket, in the phase
    that took most of it, as opaque as the share of the bucket that was busy (at least 0.2, so that a little
    work still shows). A bar counts in the bucket of its middle. A bar as long as a bucket or longer (a
    straggler's step) is drawn as it is, over its own time.
    """
    import numpy as np

    out: dict[str, list] = {name: [] for name in OVERVIEW_COLUMNS}
    if not columns["left"] or bucket_ms <= 0 or not end > start:
        return out
    left, right = np.asarray(columns["left"], dtype=float), np.asarray(columns["right"], dtype=float)
    inside = (right >= start) & (left <= end)
    if not inside.any():
        return out
    row_names, phases = np.asarray(columns["row"], dtype=object)[inside], np.asarray(columns["phase"], dtype=object)[inside]
    left, right = left[inside], right[inside]
    for i in np.nonzero(right - left >= bucket_ms)[0]:  # long enough to draw as it is
        for name, value in zip(OVERVIEW_COLUMNS, (str(row_names[i]), float(left[i]), float(right[i]), str(phases[i]),
                                                  1.0, float(right[i] - left[i]), 1)):
            out[name].append(value)
    short = right - left < bucket_ms
    if not short.any():
        return out
    left, right, row_names, phases = left[short], right[short], row_names[short], phases[short]
    rows, row_index = np.unique(row_names.astype(str), return_inverse=True)
    phase_index = np.asarray([PHASES.index(p) if p in PHASES else len(PHASES) - 1 for p in phases])
    first = int(np.floor(start / bucket_ms))
    bucket = np.floor((left + right) / 2 / bucket_ms).astype(np.int64) - first
    count = int(bucket.max()) + 1
    keep = bucket >= 0
    key = (row_index[keep] * count + bucket[keep]) * len(PHASES) + phase_index[keep]
    busy = np.bincount(key, weights=(right - left)[keep], minlength=len(rows) * count * len(PHASES))
    bars = np.bincount(key, minlength=len(rows) * count * len(PHASES))
    busy, bars = busy.reshape(len(rows), count, len(PHASES)), bars.reshape(len(rows), count, len(PHASES))
    total, dominant, number = busy.sum(axis=2), busy.argmax(axis=2), bars.sum(axis=2)
    for r, b in zip(*np.nonzero(number)):
        out["row"].append(str(rows[r]))
        out["left"].append(float((first + b) * bucket_ms))
        out["right"].append(float((first + b + 1) * bucket_ms))
        out["phase"].append(PHASES[dominant[r, b]])
        out["alpha"].append(float(min(1.0, max(0.2, total[r, b] / bucket_ms))))
        out["busy_ms"].append(float(total[r, b]))
        out["bars"].append(int(number[r, b]))
    return out


FAULT_COLUMNS = ("row", "x", "task", "kind", "detail", "job", "colour")
# Fault markers on the timeline: red for a task gone, amber for one not answering or straggling, green when it is back.
FAULT_COLOURS = {"lost": "#d62728", "failed": "#d62728", "silent": "#ff9f1c", "straggler": "#ff9f1c", "dropped": "#ff9f1c",
                 "recovering": "#9467bd", "running": "#2ca02c", "re-hosted": "#2ca02c", "restored": "#2ca02c",
                 "waited": "#2ca02c"}


def task_row(task: str, rows: list[str]) -> str | None:
    """The first timeline row of task ``worker:1`` (its CPU, or its first device), if the timeline shows it."""
    job, _, index = task.partition(":")
    prefix = f"/job:{job}/task:{index}/"
    return next((row for row in rows if row.startswith(prefix)), None)


def fault_columns(events: Iterable, rows: list[str]) -> dict[str, list]:
    """Task health events (``TaskEvent``) -> markers on the rows of their tasks (events of tasks not shown are left out)."""
    columns: dict[str, list] = {name: [] for name in FAULT_COLUMNS}
    for event in events:
        if not isinstance(event, TaskEvent) or event.kind not in FAULT_COLOURS:
            continue
        row = task_row(event.task, rows)
        if row is None:
            continue
        for name, value in zip(FAULT_COLUMNS, (row, event.time * 1000.0, event.task, event.kind, event.detail, event.job,
                                               FAULT_COLOURS[event.kind])):
            columns[name].append(value)
    return columns


def link_changes(events: Iterable) -> list[tuple[float, str]]:
    """Reshaped links (``LinkEvent``) -> ``(time in ms, shaping)``: each shades the timeline until the next."""
    return [(e.time * 1000.0, e.shaping) for e in events if isinstance(e, LinkEvent)]


def new_rows(spans: Iterable[StepSpan], known: list[str]) -> list[str]:
    """Rows the spans use that the timeline does not show yet (e.g. a task added by ``scale``)."""
    extra = []
    for span in spans:
        name = row_name(span.device)
        if name not in known and name not in extra:
            extra.append(name)
    return extra


@dataclass
class _Trained:
    """When a job trained: from its first step's start to its end (inf while it runs), a finished one to its last
    step's end."""

    first: float = math.inf
    end: float = math.inf
    last_step: float = -math.inf
    finished: bool = False
    workers: tuple = ()

    def last(self) -> float:
        return self.last_step if self.finished else self.end


@dataclass
class ThroughputBins:
    """Examples and steps per worker (and in total) in fixed time bins.

    Per worker counts its computed gradients (``compute`` spans: a worker's own work, used or
    not); ``total`` counts the steps that count (``StepDone``: one per ``job.history`` record).
    A bin is final ``settle`` seconds after it ends; results that come later still update it
    (``changed`` lists those bins). A bin is 0 only where there was something to count: while a job
    trained (from its first step to its end, from ``JobProgress``; a finished job's end is its last step's:
    what it does after it, reading its weights and letting go of its functions, is no training), and for a
    worker of that job from its first step on; elsewhere (between jobs and during a job's set-up and wrap-up,
    before a worker joined) it is NaN, which a plot draws as a break in the line rather than a fall to zero.
    """

    width: float = 1.0
    settle: float = 0.5
    bins: dict[int, dict[str, list[float]]] = field(default_factory=dict)  # bin -> series -> [examples, steps]
    series: list[str] = field(default_factory=lambda: [TOTAL])
    emitted: int | None = None  # the last bin handed out as final
    changed: set[int] = field(default_factory=set)
    jobs: dict[str, _Trained] = field(default_factory=dict)  # job -> when it trained, on which workers
    first_bin: dict[str, int] = field(default_factory=dict)  # series -> the first bin it counted anything in

    def add(self, events: Iterable) -> None:
        for event in events:
            if isinstance(event, StepDone):
                self._count(TOTAL, event.end, event.examples)
                job = self.jobs.setdefault(event.job, _Trained())
                job.first, job.last_step = min(job.first, event.start), max(job.last_step, event.end)
            elif isinstance(event, StepSpan) and event.phase == COMPUTE and event.end is not None:
                self._count(event.task, event.end, event.examples)
            elif isinstance(event, JobProgress) and event.state != QUEUED:
                job = self.jobs.setdefault(event.job, _Trained())
                job.end = event.time if event.state in ENDED else math.inf
                job.finished, job.workers = event.state == FINISHED, tuple(event.workers)

    def _active(self, index: int, series: str) -> bool:
        """Whether a job that ``series`` counts for (the total: any) trained during bin ``index``."""
        start, end = index * self.width, (index + 1) * self.width
        return any(job.first < end and job.last() >= start and (series == TOTAL or not job.workers or series in job.workers)
                   for job in self.jobs.values())

    def _count(self, series: str, t: float, examples: int) -> None:
        index = int(math.floor(t / self.width))
        if series not in self.series:
            self.series.append(series)
        self.first_bin[series] = min(index, self.first_bin.get(series, index))
        slot = self.bins.setdefault(index, {}).setdefault(series, [0.0, 0.0])
        slot[0] += examples
        slot[1] += 1
        if self.emitted is not None and index <= self.emitted:
            self.changed.add(index)

    def row(self, index: int) -> dict[str, float]:
        counts = self.bins.get(index, {})
        row = {"time": index * self.width * 1000.0}
        for name in self.series:
            if name in counts or (index >= self.first_bin.get(name, index + 1) and self._active(index, name)):
                examples, steps = counts.get(name, (0.0, 0.0))
                row[f"{name}:examples"], row[f"{name}:steps"] = examples / self.width, steps / self.width
            else:  # nothing ran that it could count: a gap, not a zero
                row[f"{name}:examples"] = row[f"{name}:steps"] = math.nan
        return row

    def final(self, now: float) -> list[dict[str, float]]:
        """Rows of the bins that became final since the last call, oldest first."""
        if not self.bins:
            return []
        last = int(math.floor((now - self.settle) / self.width)) - 1
        first = min(self.bins) if self.emitted is None else self.emitted + 1
        if last < first:
            return []
        self.emitted = last
        return [self.row(i) for i in range(first, last + 1)]

    def take_changed(self) -> list[int]:
        changed, self.changed = sorted(self.changed), set()
        return changed


RATE_WINDOW = 2.0  # seconds behind the "now" figures


class RecentRates:
    """Steps that ended in the last ``window`` seconds: per worker (its computed gradients) and in total."""

    def __init__(self, window: float = RATE_WINDOW):
        self.window = window
        self.recent: deque = deque()  # (end, series, examples), oldest first

    def add(self, events: Iterable) -> None:
        for event in events:
            if isinstance(event, StepDone):
                self.recent.append((event.end, TOTAL, event.examples))
            elif isinstance(event, StepSpan) and event.phase == COMPUTE and event.end is not None:
                self.recent.append((event.end, event.task, event.examples))

    def rates(self, now: float) -> dict[str, tuple[float, float]]:
        while self.recent and self.recent[0][0] < now - self.window:
            self.recent.popleft()
        return current_rates(self.recent, now, self.window)


def current_rates(recent: Iterable[tuple[float, str, int]], now: float, window: float) -> dict[str, tuple[float, float]]:
    """``(end, series, examples)`` of the last ``window`` s -> series -> (examples/s, steps/s) now."""
    rates: dict[str, list[float]] = {}
    for end, series, examples in recent:
        if now - window < end <= now:
            slot = rates.setdefault(series, [0.0, 0.0])
            slot[0] += examples
            slot[1] += 1
    return {name: (v[0] / window, v[1] / window) for name, v in rates.items()}


@dataclass
class JobState:
    """What the progress panel shows about one job, kept up to date from its events."""

    job: str
    steps_total: int = 0
    steps_done: int = 0
    state: str = "running"
    started: float = 0.0
    strategy: str = ""
    workers: tuple[str, ...] = ()
    transfer: str = ""
    bytes_per_step: int = 0
    last_step_end: dict[str, float] = field(default_factory=dict)  # worker -> end of its last computed step
    durations: deque = field(default_factory=lambda: deque(maxlen=500))  # recent step durations (compute and the rest)
    ended: float = 0.0  # when it finished, failed or was cancelled (0: not yet)
    examples_done: int = 0
    first_start: float = math.inf  # of the steps that count: the span its average rates are over
    last_end: float = 0.0

    def add(self, event) -> None:
        if isinstance(event, JobProgress):
            self.steps_total, self.state, self.started = event.steps_total, event.state, event.started
            self.strategy, self.workers = event.strategy, event.workers
            self.transfer, self.bytes_per_step = event.transfer, event.bytes_per_step
            self.steps_done = max(self.steps_done, event.steps_done)
            self.ended = event.time if event.state in ENDED else 0.0
        elif isinstance(event, StepDone):
            self.steps_done += 1
            self.examples_done += event.examples
            self.first_start, self.last_end = min(self.first_start, event.start), max(self.last_end, event.end)
        elif isinstance(event, StepSpan) and event.end is not None:
            if event.phase == COMPUTE:
                self.last_step_end[event.task] = max(event.end, self.last_step_end.get(event.task, 0.0))
            self.durations.append(event.end - event.start)


def progress_info(job: JobState, in_progress: list[StepSpan], now: float, rate: float) -> dict:
    """Steps done / total, ETA and notes (stale workers, steps far slower than their peers)."""
    remaining = max(job.steps_total - job.steps_done, 0)
    eta = remaining / rate if rate > 0 and job.state == "running" else None
    notes = []
    if job.state == "running" and job.durations:
        typical = statistics.median(job.durations) * 2  # a step is about a compute and an update span
        for span in in_progress:
            if span.job != job.job:
                continue
            age, expected = now - span.start, typical * span.steps
            if age > max(2.0, 5 * expected):
                notes.append(f"{span.task} has been running steps {span.step}-{span.step + span.steps - 1} for "
                             f"{age:.1f} s, {age / max(expected, 1e-6):.0f}x its peers' time: slow or stalled "
                             "(check cluster.status()).")
        running = {s.task for s in in_progress if s.job == job.job}
        latest = max(job.last_step_end.values(), default=now)
        for worker in job.workers:
            last = job.last_step_end.get(worker)
            quiet = now - (last if last is not None else job.started)
            if worker not in running and quiet > max(5.0, 20 * typical) and now - latest < quiet / 2:
                notes.append(f"{worker} reported no step for {quiet:.0f} s while its peers did: stale or lost "
                             "(check cluster.status()).")
    return {
        "job": job.job, "strategy": job.strategy, "state": job.state, "steps_done": job.steps_done,
        "steps_total": job.steps_total, "fraction": job.steps_done / job.steps_total if job.steps_total else 0.0,
        "eta_s": eta, "elapsed_s": ((job.ended or now) - job.started) if job.started else 0.0, "notes": notes,
        "transfer": job.transfer, "bytes_per_step": job.bytes_per_step, **average_rates(job),
    }


def average_rates(job: JobState) -> dict[str, float]:
    """Examples/s and steps/s over the job's counted steps so far, from the first one's start to the last one's end
    (what ``job.throughput()`` says): the figure an ended job keeps."""
    seconds = job.last_end - job.first_start
    if job.steps_done == 0 or seconds <= 0:
        return {"average_examples_per_s": 0.0, "average_steps_per_s": 0.0}
    return {"average_examples_per_s": job.examples_done / seconds, "average_steps_per_s": job.steps_done / seconds}


__all__ = ["PHASES", "RATE_WINDOW", "SPAN_COLUMNS", "TOTAL", "JobState", "RecentRates", "ThroughputBins", "average_rates",
           "current_rates", "device_rows", "new_rows", "overview_columns", "progress_info", "row_name", "span_columns"]
