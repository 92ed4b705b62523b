"""When a job saves: every ``Checkpoint.every`` steps while it trains, never while a task is silent, and at the end.

What a save writes is the job's strategy's (``job._save``); a save that found a ps gone raises ``TaskLost``,
so that the job restores, or fails.
"""

from __future__ import annotations

from ...cluster.health import SILENT
from .recovery import TaskLost, classify


def save_or_lost(job) -> None:
    """``job._save()``; a save that found a ps gone raises ``TaskLost`` (the job then restores, or fails)."""
    try:
        job._save()
    except TaskLost:
        raise
    except Exception as exc:  # noqa: BLE001 - classified
        raise classify(job, exc, "the job's checkpointing") from None


def _next_multiple(done: int, every: int) -> int:
    return done // every * every + every


def first_checkpoint_at(job) -> int:
    """The step count at which the job's first save of this run is due."""
    return _next_multiple(job.start_step + job.steps_done, job.options.checkpoint_every or 1)


def checkpoint_due(job, next_at: int) -> int:
    """Save if ``next_at`` steps are done (then return the next multiple to save at); else return ``next_at``."""
    every = job.options.checkpoint_every
    if every and job.start_step + job.steps_done >= next_at:
        if any(r.state == SILENT for r in job.cluster.tasks):
            return next_at  # saving could block on it (see PsJob._save): after it answers, or is replaced
        save_or_lost(job)
        return _next_multiple(job.start_step + job.steps_done, every)
    return next_at
