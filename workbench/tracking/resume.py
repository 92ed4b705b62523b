"""A job resumed from a checkpoint continues the tracker run of the job that wrote the checkpoint.

The run's id is kept beside the checkpoints (``workbench-runs.json`` in the checkpoint directory, one entry
per tracker): a job that starts from a checkpoint (``job.start_step > 0``) finds it there.
"""

from __future__ import annotations

import json
from pathlib import Path

RUNS_FILE = "workbench-runs.json"


def _runs_file(job) -> Path | None:
    checkpoint = job.options.checkpoint
    return Path(checkpoint.directory) / RUNS_FILE if checkpoint is not None else None


def _runs(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def run_to_continue(job, tracker: str) -> str | None:
    """The run id of ``tracker`` to continue, if ``job`` resumes from a checkpoint a tracked job wrote."""
    path = _runs_file(job)
    if path is None or job.start_step == 0:
        return None
    return _runs(path).get(tracker)


def remember_run(job, tracker: str, run_id: str) -> None:
    """Keep ``run_id`` beside the job's checkpoints, for a job that resumes from them."""
    path = _runs_file(job)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**_runs(path), tracker: run_id}))
