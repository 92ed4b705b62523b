"""Keras's ``model.fit`` loop around a job's distributed steps: epochs, validation, callbacks, TensorBoard.

A job's run (async-ps, sync-ps, all-reduce, a placed model) runs the steps; this loop says which of them
it may run now (``claimable``: those of the current epoch) and, from the run's own thread (the job's),
calls the callbacks, so that the loop itself stays free of logging, checkpointing and early stopping
(an experiment tracker's callback logs into the run active where ``wb.train`` was called, as under
``model.fit``):

* ``on_train_begin`` once the job is set up; ``on_epoch_begin(epoch)`` before the epoch's first call;
* ``on_train_batch_begin(batch)`` and ``on_train_batch_end(batch, logs)`` once per remote call that
  came back, with that call's newest step (``batch`` is its index in the epoch, ``logs`` its loss and
  metrics): a call runs ``steps_per_call`` steps, as ``steps_per_execution`` does in Keras;
* at the end of an epoch (the run has parked: no call in flight and none it may start) the validation,
  ``on_epoch_end(epoch, logs)`` with the epoch's loss and metrics averaged over its steps and the
  ``val_*`` values, then ``model.stop_training`` is looked at, and the next epoch begins.

The workers wait only at epoch ends, for the validation (spread over them) and the epoch's callbacks.
"""

from __future__ import annotations

import queue
import types
import weakref
from dataclasses import dataclass, field
from typing import Any

from ...compat import keras as keras_compat
from ...compat import mlflow as mlflow_compat
from ...errors import ConfigurationError, WorkbenchError
from ...native_logs import inform


class CallbackError(WorkbenchError):
    """A Keras callback raised: the job stops, and the message names the callback and its hook."""


@dataclass
class FitArguments:
    """What ``wb.train`` takes from ``model.fit`` beyond the options: objects, not settings."""

    validation_data: Any = None  # a data function like ``data``, or a tf.data.Dataset held in the kernel
    callbacks: list = field(default_factory=list)


def check_callbacks(callbacks: Any) -> list:
    """A list of ``keras.callbacks.Callback``; anything else gets an error saying what to pass."""
    import keras

    if callbacks is None:
        return []
    if isinstance(callbacks, keras.callbacks.Callback):
        callbacks = [callbacks]
    if not isinstance(callbacks, (list, tuple)) or not all(isinstance(c, keras.callbacks.Callback) for c in callbacks):
        raise ConfigurationError(
            f"callbacks={callbacks!r}: pass a list of keras.callbacks.Callback objects, e.g. "
            "callbacks=[keras.callbacks.EarlyStopping(patience=2), keras.callbacks.CSVLogger('log.csv')].")
    return list(callbacks)


def tensorboard_dir(callbacks: list) -> str | None:
    """Where the job's distributed scalars go: the first TensorBoard callback's directory."""
    import keras

    boards = [c for c in callbacks if isinstance(c, keras.callbacks.TensorBoard)]
    return str(boards[0].log_dir) if boards else None


def epoch_averages(records: list[dict], names: list[str]) -> dict[str, float]:
    """The loss and metrics ``names`` averaged over an epoch's step records (every step weighs the same)."""
    if not records:
        return {}
    return {name: sum(float(r[name]) for r in records) / len(records) for name in ["loss", *names]}


def validation_due(epoch: int, freq: int) -> bool:
    """Keras's rule: validate after epochs ``freq - 1``, ``2 freq - 1``, ..."""
    return (epoch + 1) % freq == 0


class EpochLoop:
    """The epochs of one job, its callbacks and its TensorBoard runs (see the module's docstring)."""

    def __init__(self, job, arguments: FitArguments | None = None):
        import keras

        arguments = arguments or FitArguments()
        self._job = weakref.ref(job)  # not a cycle: an ended job nobody holds is freed at once (see driver.drive)
        self.validation_data = arguments.validation_data
        self.user_callbacks = list(arguments.callbacks)
        users_history = [c for c in self.user_callbacks if isinstance(c, keras.callbacks.History)]
        self.history = users_history[0] if users_history else keras.callbacks.History()
        self.callbacks = self.user_callbacks + ([] if users_history else [self.history])
        self.log_dir = tensorboard_dir(self.user_callbacks)
        self._records: queue.SimpleQueue = queue.SimpleQueue()  # (record, newest step of its call)
        self.epoch = 0
        self.limit = 0  # steps below it may run (the end of the current epoch)
        self.closing = False  # a callback set model.stop_training: no new call; the epoch ends when the run parks
        self.finished = False  # the last epoch ended (or the one a callback stopped)
        self.stopped_early = False
        self.last_logs: dict = {}
        self.model = None
        self._sync = None  # where the callbacks' model is a local copy: fetches and pushes its weights
        self._restore_classes: list[tuple[Any, type]] = []
        self._scalars = None  # JobScalars, for TensorBoard and the callbacks that take them (wb.tracking's)
        self._faults_written = self._scales_written = 0
        self._begun = False
        # made in the thread that called wb.train: the callbacks log into its experiment tracker's active run
        self._caller_runs = mlflow_compat.caller_runs()
        for callback in self.user_callbacks:
            if hasattr(callback, "set_job"):  # wb.tracking's: told of the job in the caller's thread
                callback.set_job(job)

    # -- what the runs ask ----------------------------------------------------------------------

    @property
    def job(self):
        return self._job()

    @property
    def per_epoch(self) -> int:
        return self.job.options.epoch_steps

    def claimable(self, step: int) -> bool:
        """Whether a call starting at ``step`` may be made now."""
        return not self.closing and not self.finished and step < self.limit

    def step_done(self, record: dict, last_of_call: bool) -> None:
        """A step's record (any thread, under the job's lock with its append): for the callbacks and TensorBoard."""
        self._records.put((record, last_of_call))

    # -- the job's thread -------------------------------------------------------------------------

    def begin(self) -> None:
        """The job is set up: its callbacks get their model and parameters, ``on_train_begin``, the first epoch."""
        options = self.job.options
        done = self.job.start_step + self.job.steps_done
        self.epoch = done // self.per_epoch
        self.limit = min((self.epoch + 1) * self.per_epoch, options.steps)
        self._set_model()
        params = {"verbose": 0, "epochs": options.epochs, "steps": self.per_epoch}
        for callback in self.callbacks:
            callback.set_params(params)
        sinks = [c for c in self.user_callbacks if hasattr(c, "log_scalars") and hasattr(c, "log_text")]
        if self.log_dir is not None:
            from ...telemetry.tensorboard import TensorBoardSink

            sinks.insert(0, TensorBoardSink(self.log_dir))
        if sinks:
            from ...telemetry.job_scalars import JobScalars

            self._scalars = JobScalars(sinks)
        self._begun = True
        self._dispatch("on_train_begin", {})
        self._dispatch("on_epoch_begin", self.epoch, {})

    def _set_model(self) -> None:
        if self.user_callbacks:
            self.model, self._sync = self.job.trainer.callback_model()
        else:  # the History alone needs no model: it only leaves itself on it
            self.model, self._sync = types.SimpleNamespace(stop_training=False), None
        self.model.stop_training = False
        for callback in self.callbacks:
            callback.set_model(self.model)
            if self._sync is not None and callback is not self.history and not self._watched(callback):
                self._restore_classes.append((callback, keras_compat.watch_model_reads(callback, self._sync.read)))
        self.model.history = self.history

    def _watched(self, callback) -> bool:
        return any(c is callback for c, _ in self._restore_classes)

    def model_replaced(self) -> None:
        """The job built its variables again (a lost task was re-hosted): the callbacks get the new model."""
        if self._begun:
            stop = bool(getattr(self.model, "stop_training", False))
            self._set_model()
            self.model.stop_training = stop

    def tick(self, parked: bool) -> None:
        """From the run's thread: the batch hooks of the calls that came back; the end of the epoch if ``parked``."""
        if self.finished or self.job.stop_requested:
            return
        self._drain()
        self._write_events()
        complete = self.job.start_step + self.job.steps_done >= self.limit
        if parked and (self.closing or complete):
            self._end_epoch()

    def _drain(self) -> None:
        records = []
        while True:
            try:
                record, last = self._records.get_nowait()
            except queue.Empty:
                break
            records.append((record, last))
        first = self.epoch * self.per_epoch
        # a step redone after a restore, of an epoch over, has no hook; async-ps calls end in any order
        for record in sorted((r for r, last in records if last and r["step"] >= first), key=lambda r: r["step"]):
            logs = {name: record[name] for name in ["loss", *self.job.metric_names]}
            batch = record["step"] - first
            self._dispatch("on_train_batch_begin", batch, {})
            self._dispatch("on_train_batch_end", batch, logs)
        records = [r for r, _ in records]
        if records and self._scalars is not None:
            self._scalars.steps(records)

    def _write_events(self) -> None:
        """The faults and scales since the last look, to TensorBoard and the trackers."""
        if self._scalars is None:
            return
        faults, scales = self.job.faults, self.job.events
        for fault in faults[self._faults_written:]:
            self._scalars.fault(fault, self.job.start_step + self.job.steps_done)
        for event in scales[self._scales_written:]:
            self._scalars.scale(event)
        self._faults_written, self._scales_written = len(faults), len(scales)

    def _end_epoch(self) -> None:
        options, job = self.job.options, self.job
        first = self.epoch * self.per_epoch
        records = [r for r in job.history if first <= r["step"] < self.limit]
        logs = epoch_averages(records, job.metric_names)
        if self.validation_data is not None and validation_due(self.epoch, options.validation_freq):
            values = job.trainer.validate(self.validation_data, options.validation_steps)
            logs.update({f"val_{name}": value for name, value in values.items() if name != "examples"})
        if self._scalars is not None:
            self._scalars.epoch(records, job.options.strategy.epoch_scalars, job.trainer.bytes_per_step(), self.limit)
        self._dispatch("on_epoch_end", self.epoch, logs)
        self.last_logs = logs
        if self.closing or self.limit >= options.steps:
            self.stopped_early = job.start_step + job.steps_done < options.steps
            self.finished = True
            return
        self.epoch += 1
        self._dispatch("on_epoch_begin", self.epoch, {})
        self.limit = min((self.epoch + 1) * self.per_epoch, options.steps)  # releases the epoch's calls

    def end(self, finished: bool) -> None:
        """The job ended: ``on_train_end`` if it finished (as ``model.fit`` on return); the sinks told how it ended
        (files closed, trackers' runs ended), classes put back."""
        try:
            if finished and self._begun:
                self._drain()
                self._write_events()
                self._dispatch("on_train_end", self.last_logs)
        finally:
            scalars, self._scalars = self._scalars, None
            if scalars is not None:
                scalars.steps([], now=True)
                state = "finished" if finished else "cancelled" if self.job.stop_requested else "failed"
                for sink in scalars.sinks:  # each ends: one that raises does not keep the others' runs open
                    try:
                        sink.end_job(state)
                    except Exception as exc:  # noqa: BLE001 - the job's own outcome stands; say what was lost
                        inform(f"{type(sink).__name__} could not end its run: {type(exc).__name__}: {exc}",
                               f"job {self.job.name}")
            for callback, base in self._restore_classes:
                callback.__class__ = base
            self._restore_classes = []

    def _dispatch(self, hook: str, *args) -> None:
        """Call ``hook`` on every callback, in order; one that raises stops the job with a ``CallbackError``."""
        if self._sync is not None:
            self._sync.stale()
        mlflow_compat.share_runs(self._caller_runs)
        for callback in self.callbacks:
            try:
                getattr(callback, hook)(*args)
            except Exception as exc:  # the user's code: named, with its own traceback chained
                raise CallbackError(f"callback {type(callback).__name__}.{hook} raised {type(exc).__name__}: {exc}") from exc
        if self._sync is not None:
            self._sync.push_changes()
        if getattr(self.model, "stop_training", False) and not self.closing:
            self.closing = True
