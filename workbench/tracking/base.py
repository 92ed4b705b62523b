"""What every tracker callback of the workbench records about a job, whatever the tracker.

``JobTracker`` is a Keras callback that ``wb.train`` also tells of its job (``set_job``, in the thread that
called ``wb.train``) and hands the job's per-task figures (``log_scalars``, ``log_text``: see
``telemetry/job_scalars.py``) and its end (``end_job``). It turns them into one run per job: the
parameters (``job_params``), the epoch metrics, each worker's series, the events, and the artifacts at the
end. A subclass says how its tracker stores each of them (``_start``, ``_metrics``, ``_event``,
``_files``, ``_end``); it runs in the job's thread and calls its tracker's client with an explicit run,
so nothing depends on which thread is active where.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import tempfile
import time
import weakref
from pathlib import Path

import keras

from ..errors import TrackingWarning
from ..native_logs import notice
from ..telemetry.tensorboard import run_name

SEND_SECONDS = 1.0  # metrics go to the tracker together at most this often: each send costs the kernel CPU the tasks want


def _flat(prefix: str, value, out: dict) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flat(f"{prefix}.{key}" if prefix else str(key), inner, out)
    elif isinstance(value, (list, tuple)):
        out[prefix] = ", ".join(str(v) for v in value)
    elif value is not None:
        out[prefix] = value


def job_params(job, model) -> dict:
    """Everything that says how ``job`` trains, flat (``strategy.backup_workers``, ``cluster.hosts.worker:0``...)."""
    import tensorflow as tf

    from .._version import __version__

    options, cluster = job.options, job.cluster
    tasks = list(cluster.tasks)
    nested = {
        "job": job.name,
        "strategy": {"name": options.strategy.name, **dataclasses.asdict(options.strategy)},
        "recovery": dataclasses.asdict(options.recovery),
        "checkpoint": dataclasses.asdict(options.checkpoint) if options.checkpoint else None,
        "steps": options.steps, "epochs": options.epochs, "steps_per_epoch": options.epoch_steps,
        "global_batch_size": options.batch_size, "per_worker_batch_size": options.per_worker_batch,
        "seed": options.seed, "metrics": [getattr(m, "name", m) for m in options.metrics] or None,
        "validation_steps": options.validation_steps, "validation_freq": options.validation_freq,
        "cluster": {"name": cluster.name, "ps": sum(t.job == "ps" for t in tasks),
                    "workers": sum(t.job == "worker" for t in tasks),
                    "hosts": {t.name: t.address or t.host for t in tasks}},
        "versions": {"workbench": __version__, "tensorflow": tf.__version__, "keras": keras.__version__,
                     "python": platform.python_version()},
    }
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and hasattr(optimizer, "get_config"):
        nested["optimizer"] = {k: v for k, v in optimizer.get_config().items() if isinstance(v, (int, float, str, bool))}
    if hasattr(model, "count_params"):
        nested["model"] = {"parameters": model.count_params()}
    params: dict = {}
    _flat("", nested, params)
    return params


def event_line(event: dict) -> str:
    """A fault or scale as a tracker shows it: ``step 120: worker:1 faults: lost: re-hosted ...``."""
    return f"step {event['step']}: {event['task']} {event['kind']}: {event['text']}"


def model_summary(model) -> str:
    lines: list[str] = []
    try:
        model.summary(print_fn=lambda line, *args, **kwargs: lines.append(line))
    except Exception as exc:  # noqa: BLE001 - a model Keras cannot summarise still trains; say so in its place
        return f"(no summary: {type(exc).__name__}: {exc})"
    return "\n".join(lines)


class JobTracker(keras.callbacks.Callback):
    """One run per job in an experiment tracker (see the module's docstring; ``wb.tracking.MLflow``, ``WandB``).

    log_model: the trained model as a ``.keras`` file, when the job finished.
    log_checkpoints: the job's checkpoint directory (``wb.train(checkpoint=...)``), when it ends.
    log_timeline: the job's step timeline (``job.timeline.save``), a trace Perfetto opens, when it ends.
    """

    def __init__(self, *, log_model: bool = True, log_checkpoints: bool = True, log_timeline: bool = True):
        super().__init__()
        self.log_model, self.log_checkpoints, self.log_timeline = log_model, log_checkpoints, log_timeline
        self._job = None
        self._started = False
        self.events: list[dict] = []
        self._rows: dict[tuple[str, int], dict[str, float]] = {}  # (axis, step) -> values not sent yet
        self._sent_at = 0.0
        self._failed = False  # the tracker failed mid-job: the run is left alone, the job goes on

    @property
    def job(self):
        return self._job() if self._job is not None else None

    # -- told by the job's loop ------------------------------------------------------------------

    def set_job(self, job) -> None:
        """The job this callback tracks (in the thread that called ``wb.train``: a tracker's context is read here)."""
        self._job = weakref.ref(job)  # the job holds its callbacks: no cycle
        self._started, self.events, self._rows, self._failed = False, [], {}, False
        self._caller(job)

    def on_train_begin(self, logs=None) -> None:
        job = self.job
        self._start(job.name, job_params(job, self.model), {"workbench.job": job.name, "workbench.cluster": job.cluster.name,
                                                            "workbench.strategy": job.options.strategy.name})
        self._started = True
        with tempfile.TemporaryDirectory(prefix="workbench-track-") as folder:
            summary = Path(folder) / "model_summary.txt"
            summary.write_text(model_summary(self.model))
            self._files({summary: ""})

    def on_epoch_end(self, epoch, logs=None) -> None:
        values = {name: float(value) for name, value in (logs or {}).items() if _is_number(value)}
        if values and self._live():
            self._add("epoch", epoch, values)

    def log_scalars(self, task: str, step: int, values: dict[str, float]) -> None:
        if self._live():
            self._add("step", step, {f"{tag}/{run_name(task)}": float(v) for tag, v in values.items()})

    def _live(self) -> bool:
        return self._started and not self._failed

    def _guarded(self, what: str, action) -> None:
        """Do ``action`` (a call to the tracker); if the tracker fails, say so once and leave the run alone: a
        tracker that went away must not stop the training it watches."""
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - any tracker's error: the job goes on without it
            self._failed = True
            job = self.job
            notice(f"{type(self).__name__} could not {what}: {type(exc).__name__}: {exc}. The job goes on; this "
                   "run is not updated any more.", TrackingWarning, f"job {job.name}" if job is not None else "")

    def _add(self, axis: str, step: int, values: dict[str, float]) -> None:
        self._rows.setdefault((axis, int(step)), {}).update(values)
        if time.monotonic() - self._sent_at >= SEND_SECONDS:
            self._send()

    def _send(self) -> None:
        rows, self._rows, self._sent_at = self._rows, {}, time.monotonic()
        if rows and self._live():
            self._guarded("log metrics", lambda: self._metrics([(axis, step, values) for (axis, step), values in rows.items()]))

    def log_text(self, task: str, step: int, kind: str, text: str) -> None:
        event = {"step": step, "task": task, "kind": kind, "text": text}
        self.events.append(event)
        if self._live():
            self._guarded("log an event", lambda: self._event(len(self.events) - 1, event))

    def end_job(self, state: str) -> None:
        """The job ended (``finished``, ``failed``, ``cancelled``): its artifacts, then the run's end."""
        if not self._started:
            return
        job = self.job
        self._send()
        if self._live():
            with tempfile.TemporaryDirectory(prefix="workbench-track-") as folder:
                self._guarded("store the run's files", lambda: self._files(self._artifacts(job, Path(folder), state)))
        failed = self._failed
        self._guarded("end the run", lambda: self._end("failed" if failed else state))
        self._started = False

    def _artifacts(self, job, folder: Path, state: str) -> dict[Path, str]:
        files = {}
        events = folder / "events.json"
        events.write_text(json.dumps(self.events, indent=1))
        files[events] = ""
        if self.log_timeline and job is not None:
            timeline = folder / "timeline.json"
            job.timeline.save(str(timeline))
            files[timeline] = ""
        if self.log_model and state == "finished" and job is not None:
            path = folder / f"{job.name}.keras"
            job.model.save(str(path))  # a local model with the trained weights, whatever the strategy
            files[path] = "model"
        checkpoint = job.options.checkpoint if job is not None else None
        if self.log_checkpoints and checkpoint is not None and Path(checkpoint.directory).is_dir():
            files[Path(checkpoint.directory)] = "checkpoints"
        return files

    # -- what a tracker implements (the job's thread) -----------------------------------------------

    def _caller(self, job) -> None:
        """In the thread that called ``wb.train``: read what the tracker keeps there (an active run, a project)."""

    def _start(self, name: str, params: dict, tags: dict) -> None:
        raise NotImplementedError

    def _metrics(self, rows: list[tuple[str, int, dict[str, float]]]) -> None:
        """Rows gathered over up to ``SEND_SECONDS``, in one send: ``(axis, step, values)``, where ``axis`` is
        ``"epoch"`` (Keras's logs, at the epoch) or ``"step"`` (the tasks' figures, at the global step)."""
        raise NotImplementedError

    def _event(self, index: int, event: dict) -> None:
        raise NotImplementedError

    def _files(self, files: dict[Path, str]) -> None:
        """Each file or directory, stored under the given folder of the run's artifacts (``""``: at the top)."""
        raise NotImplementedError

    def _end(self, state: str) -> None:
        raise NotImplementedError


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True
