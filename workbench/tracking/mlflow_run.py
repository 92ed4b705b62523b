"""``wb.tracking.MLflow``: one MLflow run per job, through ``MlflowClient`` with the run named explicitly."""

from __future__ import annotations

import time
from pathlib import Path

from ..compat import mlflow as mlflow_compat
from ..optional import require
from .base import JobTracker, event_line
from .resume import remember_run, run_to_continue

_STATUS = {"finished": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}
BATCH = 100  # MLflow takes at most 100 parameters per log_batch


class MLflow(JobTracker):
    """A Keras callback for ``wb.train``: each job one MLflow run with what makes it distributed.

    The run (named after the job) holds the job's parameters (strategy and its options, cluster shape and
    hosts, batch sizes, seed, recovery and checkpoint settings, optimizer, versions), the epoch metrics and
    ``val_*`` values at each epoch, each worker's ``examples_per_second/worker-N`` and
    ``step_time_seconds/worker-N`` (a point a second at most, at the global step), ``staleness/worker-N``
    (async-ps) and ``dropped_gradients/worker-N`` (sync-ps) per epoch, each fault and scale as a tag
    ``workbench.event.NNN`` ("step 120: worker:1 faults: lost: re-hosted ..."), and as artifacts the model
    summary, ``events.json``, the job's timeline (``timeline.json``, for Perfetto), the trained model
    (``model/<job>.keras``) and the checkpoints. A job resumed from a checkpoint (``wb.Checkpoint(resume=True)``)
    continues the run of the job that wrote it.

    experiment: the experiment's name (created if new); by default the one ``mlflow.set_experiment`` chose.
    tracking_uri: by default MLflow's (``mlflow.set_tracking_uri``, ``MLFLOW_TRACKING_URI``).
    A run active where ``wb.train`` was called (``with mlflow.start_run():``) becomes the parent of the
    jobs' runs, so that a sweep's jobs appear under it.
    """

    def __init__(self, experiment: str | None = None, *, tracking_uri: str | None = None, log_model: bool = True,
                 log_checkpoints: bool = True, log_timeline: bool = True):
        super().__init__(log_model=log_model, log_checkpoints=log_checkpoints, log_timeline=log_timeline)
        require("mlflow", "wb.tracking.MLflow")
        self.experiment, self.tracking_uri = experiment, tracking_uri
        self.run_id: str | None = None
        self._client = self._experiment_id = self._parent = None

    def _caller(self, job) -> None:
        import mlflow

        self._client = mlflow.MlflowClient(self.tracking_uri or mlflow.get_tracking_uri())
        if self.experiment is None:
            self._experiment_id = mlflow_compat.current_experiment_id()
        else:
            found = self._client.get_experiment_by_name(self.experiment)
            self._experiment_id = found.experiment_id if found else self._client.create_experiment(self.experiment)
        active = mlflow.active_run()
        self._parent = active.info.run_id if active else None

    def _start(self, name: str, params: dict, tags: dict) -> None:
        from mlflow.entities import Param

        continued = run_to_continue(self.job, "mlflow")
        if continued:
            self.run_id = continued
            self._client.update_run(continued, status="RUNNING")
            logged = self._client.get_run(continued).data.params
            params = {k: v for k, v in params.items() if k not in logged}  # MLflow keeps a parameter's first value
        else:
            if self._parent:
                tags = {**tags, "mlflow.parentRunId": self._parent}
            self.run_id = self._client.create_run(self._experiment_id, run_name=name, tags=tags).info.run_id
            remember_run(self.job, "mlflow", self.run_id)
        items = [Param(key, str(value)[:6000]) for key, value in params.items()]
        for first in range(0, len(items), BATCH):
            self._client.log_batch(self.run_id, params=items[first:first + BATCH])

    def _metrics(self, rows: list[tuple[str, int, dict[str, float]]]) -> None:
        """One batch, queued: MLflow's own thread stores it, and the job's thread goes back to handing out work."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for _axis, step, values in rows for key, value in values.items()]
        for first in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per log_batch
            self._client.log_batch(self.run_id, metrics=metrics[first:first + 1000], synchronous=False)

    def _event(self, index: int, event: dict) -> None:
        self._client.set_tag(self.run_id, f"workbench.event.{index:03d}", event_line(event), synchronous=False)

    def _files(self, files: dict[Path, str]) -> None:
        for path, folder in files.items():
            if path.is_dir():
                self._client.log_artifacts(self.run_id, str(path), folder or None)
            else:
                self._client.log_artifact(self.run_id, str(path), folder or None)

    def _end(self, state: str) -> None:
        import mlflow

        mlflow.flush_async_logging()  # what was queued is stored before the run says it ended
        self._client.set_terminated(self.run_id, _STATUS.get(state, "FAILED"))
