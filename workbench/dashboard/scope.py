"""One job's view of a cluster's event log: what a dashboard that follows that job reads (pure: no Bokeh).

``JobView`` answers ``since``, ``in_progress`` and ``cursor`` as ``EventLog`` does, so every component
reads it unchanged: the job's own events (steps, progress, its findings about tasks), and the
cluster's task events and link changes while it ran. It knows when the job began and ended, so a
dashboard can span exactly that time and stop updating once it is over.
"""

from __future__ import annotations

import math

from ..cluster.jobs import ENDED, QUEUED
from ..telemetry.events import JobProgress, LinkEvent, StepSpan, TaskEvent
from ..telemetry.log import Batch, EventLog


class JobView:
    """The events of job ``job`` in ``log`` (and the cluster's, while it ran)."""

    def __init__(self, log: EventLog, job: str):
        self.log, self.job = log, job
        self.started = math.nan  # when it began (its first JobProgress), NaN until then
        self.ended = math.nan  # when it finished, failed or was cancelled, NaN until then

    @property
    def cursor(self) -> int:
        return self.log.cursor

    @property
    def over(self) -> bool:
        """The job ended, and its last events have been read."""
        return not math.isnan(self.ended)

    def since(self, cursor: int, limit: int | None = None) -> Batch:
        batch = self.log.since(cursor, limit)
        return Batch([e for e in batch.events if self._keep(e)], batch.cursor, batch.missed)

    def in_progress(self) -> list[StepSpan]:
        return [span for span in self.log.in_progress() if span.job == self.job]

    def _keep(self, event) -> bool:
        if isinstance(event, JobProgress) and event.job == self.job and event.state != QUEUED:
            if math.isnan(self.started):
                self.started = event.started or event.time
            if event.state in ENDED:
                self.ended = event.time
        if getattr(event, "job", "") == self.job:
            return True
        if isinstance(event, (TaskEvent, LinkEvent)) and not getattr(event, "job", ""):
            return not math.isnan(self.started) and not event.time > self.ended  # NaN end: still running
        return False


__all__ = ["JobView"]
