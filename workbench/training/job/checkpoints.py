"""When a job saves: every ``Checkpoint.every`` steps while it trains, never while a task is silent, and at the end.

What a save writes is the job's trainer's (``job.save_checkpoint``); a save that found a ps gone raises ``TaskLost``,
so that the job restores, or fails.
"""

from __future__ import annotations

import threading

from ...cluster.health import SILENT
from .recovery import TaskLost, classify


def save_or_lost(job) -> None:
    """``job.save_checkpoint()``; a save that found a ps gone raises ``TaskLost`` (the job then restores, or fails)."""
    try:
        job.save_checkpoint()
    except TaskLost:
        raise
    except Exception as exc:  # noqa: BLE001 - classified
        raise classify(job, exc, "the job's checkpointing") from None


def _next_multiple(done: int, every: int) -> int:
    return done // every * every + every


class Cadence:
    """When the steps of one run of a job are due a save: every ``Checkpoint.every`` steps from the run's start.

    Held by the job for its current run (``driver``): the threads that record a call's steps (each worker's in
    async-ps) ask it in turn, right after they recorded, so that checkpoints land close to each multiple.
    """

    def __init__(self, job):
        self._lock = threading.Lock()
        self._every = job.options.checkpoint_every
        self._next = _next_multiple(job.start_step + job.steps_done, self._every or 1)

    def due(self, step: int) -> bool:
        """Whether a save falls due once the steps before ``step`` are recorded (the job saves every few steps)."""
        with self._lock:
            return bool(self._every) and step >= self._next

    def steps_recorded(self, job) -> None:
        """Save if the next multiple is done, unless a task is silent (a save could block on it: after it answers,
        or is replaced, see ``PsTrainer.save``)."""
        every = self._every
        with self._lock:
            if not every or job.start_step + job.steps_done < self._next:
                return
            if any(r.state == SILENT for r in job.cluster.tasks):
                return
            save_or_lost(job)
            self._next = _next_multiple(job.start_step + job.steps_done, every)
