"""The newest job at a glance, from the telemetry log (pure: no Bokeh).

The progress panel draws it; ``GET <dashboard server>/summary.json`` serves it (for the
JupyterLab panel's live figure of each cluster).
"""

from __future__ import annotations

import time
from collections import deque

from ..cluster.jobs import ENDED, QUEUED, RUNNING
from ..telemetry.events import JobProgress, StepDone
from ..telemetry.log import EventLog
from .data import TOTAL, JobState, RecentRates, progress_info

ETA_WINDOW = 10.0  # seconds of steps behind the ETA
MAX_BATCHES = 100  # batches one update reads at most (the log itself is bounded)


class JobSummary:
    """Reads the log from its own cursor; ``update()`` returns the newest job's progress and rates."""

    def __init__(self, log: EventLog, events_per_update: int = 20_000):
        self.log = log
        self.cursor = 0
        self.events_per_update = events_per_update
        self.jobs: dict[str, JobState] = {}
        self.latest: str | None = None
        self.done_ends: deque = deque()  # ends of the newest job's steps, for the ETA
        self.rates = RecentRates()
        self.info: dict | None = None

    def update(self, now: float | None = None) -> dict | None:
        now = time.time() if now is None else now
        for _ in range(MAX_BATCHES):  # catch up with the log (a first read of a busy cluster's log: many batches)
            batch = self.log.since(self.cursor, self.events_per_update)
            self.cursor = batch.cursor
            self._take(batch.events)
            if len(batch.events) < self.events_per_update:
                break
        while self.done_ends and self.done_ends[0] < now - ETA_WINDOW:
            self.done_ends.popleft()
        rates = self.rates.rates(now)
        queued = [f"job {j.job} ({j.strategy}, {j.steps_total} steps)" for j in self.jobs.values() if j.state == QUEUED]
        others = [f"job {j.job} ({j.strategy}, {j.steps_done}/{j.steps_total} steps)" for j in self.jobs.values()
                  if j.state == RUNNING and j.job != self.latest]  # another kernel's, attached to this cluster
        if self.latest is None:
            return None
        info = progress_info(self.jobs[self.latest], self.log.in_progress(), now, len(self.done_ends) / ETA_WINDOW)
        if info["state"] in ENDED:  # what it did, not the silence after it
            examples, steps = info["average_examples_per_s"], info["average_steps_per_s"]
            workers = {}
        else:
            examples, steps = rates.get(TOTAL, (0.0, 0.0))
            workers = {w: {"examples_per_s": r[0], "steps_per_s": r[1]} for w, r in rates.items() if w != TOTAL}
        info.update(examples_per_s=examples, steps_per_s=steps, queued=queued, running=others, workers=workers)
        self.info = info
        return info

    def _take(self, events: list) -> None:
        for event in events:
            name = getattr(event, "job", "")
            if isinstance(event, JobProgress) and name not in self.jobs:
                self.jobs[name] = JobState(name)
            if isinstance(event, JobProgress) and event.state == RUNNING and name != self.latest:
                self.latest = name  # the job that began last (queued ones show under it; one cancelled in the queue never)
                self.done_ends.clear()
            if name in self.jobs:
                self.jobs[name].add(event)
            if isinstance(event, StepDone) and name == self.latest:
                self.done_ends.append(event.end)
        self.rates.add(events)
