"""``wb.tracking.WandB``: one Weights & Biases run per job, logged through the run object it made."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..optional import require
from .base import JobTracker, event_line
from .resume import remember_run, run_to_continue

_EXIT = {"finished": 0, "cancelled": 1, "failed": 1}


class WandB(JobTracker):
    """A Keras callback for ``wb.train``: each job one W&B run with what makes it distributed.

    ``wandb.init`` once per job (the run named after the job, ``reinit="create_new"``: a run the notebook has
    open stays as it is), with the job's parameters as the run's config; the epoch metrics (``epoch/loss``,
    ``epoch/val_accuracy``..., against ``epoch``); each worker's series grouped by figure
    (``examples_per_second/worker-0``, ``step_time_seconds/worker-1``, ``staleness/...``,
    ``dropped_gradients/...``, against ``global_step``); each fault and scale as a row of the ``events`` table
    (step, task, kind, text) logged at the end, and in the run's summary as it happens; the model summary,
    ``events.json``, the job's timeline, the trained model and the checkpoints in the run's files. A job
    resumed from a checkpoint continues the run of the job that wrote it.

    project, group, mode, dir, and any other keyword: passed to ``wandb.init`` (``mode="offline"`` writes the
    run under ``dir`` for ``wandb sync``). ``project`` and ``group`` default to those of a run open where
    ``wb.train`` was called.
    """

    def __init__(self, project: str | None = None, *, group: str | None = None, log_model: bool = True,
                 log_checkpoints: bool = True, log_timeline: bool = True, **init_kwargs):
        super().__init__(log_model=log_model, log_checkpoints=log_checkpoints, log_timeline=log_timeline)
        require("wandb", "wb.tracking.WandB")
        self.project, self.group, self.init_kwargs = project, group, init_kwargs
        self.run = None
        self._defaults: dict = {}

    def _caller(self, job) -> None:
        import wandb

        open_run = wandb.run
        self._defaults = {"project": self.project or (open_run.project if open_run else None),
                          "group": self.group or (open_run.group if open_run else None)}

    def _start(self, name: str, params: dict, tags: dict) -> None:
        import wandb

        continued = run_to_continue(self.job, "wandb")
        resume = {"id": continued, "resume": "allow"} if continued else {}
        self.run = wandb.init(name=name, config=params, tags=[f"{k}={v}" for k, v in tags.items()],
                              reinit="create_new", **{k: v for k, v in self._defaults.items() if v}, **resume,
                              **self.init_kwargs)
        self.run.define_metric("epoch")
        self.run.define_metric("epoch/*", step_metric="epoch")
        self.run.define_metric("global_step")
        for figure in ("examples_per_second", "step_time_seconds", "staleness", "dropped_gradients", "bytes_per_step"):
            self.run.define_metric(f"{figure}/*", step_metric="global_step")
        if not continued:
            remember_run(self.job, "wandb", self.run.id)

    def _metrics(self, rows: list[tuple[str, int, dict[str, float]]]) -> None:
        for axis, step, values in rows:
            if axis == "epoch":
                self.run.log({"epoch": step, **{f"epoch/{k}": v for k, v in values.items()}})
            else:
                self.run.log({"global_step": step, **values})

    def _event(self, index: int, event: dict) -> None:
        self.run.summary[f"event/{index:03d}"] = event_line(event)

    def _files(self, files: dict[Path, str]) -> None:
        for path, folder in files.items():
            target = Path(self.run.dir) / folder / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            if path.is_dir():
                shutil.copytree(path, target, dirs_exist_ok=True)
            else:
                shutil.copy2(path, target)

    def _end(self, state: str) -> None:
        import wandb

        if self.events:
            rows = [[e["step"], e["task"], e["kind"], e["text"]] for e in self.events]
            self.run.log({"events": wandb.Table(columns=["step", "task", "kind", "text"], data=rows)})
        self.run.finish(exit_code=_EXIT.get(state, 1))
