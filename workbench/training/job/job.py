"""A training job on a cluster (``wb.Job``): its life from submission to its end, whatever the strategy.

The job waits its turn in the cluster's queue, runs in a thread of its own (``driver.py``), keeps
one record per step (``history``), the faults of its tasks (``faults``, from ``recovery.py``) and
the checkpoints due, and reports progress to the dashboards. What a strategy builds and runs is
its subclass's, in ``strategies/``: ``PsJob`` (``ps/job.py``: variables on the ps tasks, loops in
``async_ps.py`` and ``sync_ps/``), ``PlacedJob`` (``placed.py``), ``AllReduceJob`` (``allreduce/``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from ...cluster.jobs import CANCELLED, ENDED, QUEUED, RUNNING, STOPPING
from ...errors import ClusterStateError
from ...telemetry.recorder import StepRecorder
from ..fit.evaluation import batch_function, check_evaluation_data, evaluate_dataset, is_dataset
from ..fit.loop import EpochLoop, FitArguments
from ..modelling.losses import resolve_metrics
from ..options import TrainOptions
from .driver import TASKS_READY_SECONDS, drive
from .records import make_step_record, throughput_of
from .recovery import Supervisor
from .scaling import Scales
from .workers import wait_for_event

_JOB_NUMBERS = itertools.count(1)


def _caller_dtype_policy():
    import keras

    return keras.config.dtype_policy()


class Job:
    """A training job on a cluster. Returned by ``wb.train``.

    A cluster runs one job at a time (``cluster.jobs`` lists them): a job submitted while another runs
    waits in state ``queued`` and begins when the cluster is free. ``state`` is one of ``queued``,
    ``running``, ``stopping``, ``finished``, ``failed``, ``cancelled``.

    ``wait()`` blocks until it ends; ``stop()`` stops it (or ``cancel()``, which also drops a queued one);
    ``history`` holds one record per step; ``evaluate(data)`` runs on the trained variables; ``model``
    is a local Keras model with the trained weights; ``faults`` lists the tasks lost, hung or
    straggling during the job and what was done about it.

    The life of a job (queue, thread, records, faults, checkpoints due, waiting and stopping) is here;
    each strategy's class builds and runs it: ``PsJob`` (async-ps, sync-ps; ``PlacedJob`` for a placed
    model) and ``AllReduceJob``. They provide ``_setup`` (called in the job's thread when its turn
    comes), ``_run`` (the steps), ``_save`` and ``_restore_state`` (checkpoints), and ``model`` and
    the evaluation hooks (``_evaluate_data_function``, ``_example_rank``, ``_callback_model``, ``_validate``).
    """

    _holders = "parameter server"  # what the tasks whose loss needs a restore are, in messages
    _uses_connection = True  # runs ops through this kernel's TF connection (allreduce runs on the engines only)

    def __init__(self, cluster, model: Any, data: Callable, loss: Any, optimizer: Any, options: TrainOptions,
                 fit: FitArguments | None = None):
        self.cluster = cluster
        self.options = options
        self._data = data
        self._model_source = model
        self._optimizer_source = optimizer
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._history: list[dict] = []
        self.state = QUEUED
        self.error: BaseException | None = None
        self.dropped_gradients = 0
        self.lost_workers: list[str] = []  # workers the job lost and finished without
        self.last_checkpoint: str | None = None
        self.start_step = 0
        self.recoveries = 0  # restores from a checkpoint so far (a ps, or an all-reduce worker, was lost)
        self._faults: list = []
        self._cadence = None  # when the current run's steps are due a save (checkpoints.Cadence, set by the driver)
        self._scales = Scales(self._lock)  # cluster.scale while it trains: requests to follow, changes made (events)
        self._supervisor: Supervisor | None = None
        self.placer = None  # ps strategies: where each variable went (a PsPlacer)
        self._workers = [r for r in cluster.tasks if r.job == "worker"]
        self.metric_names = list(resolve_metrics(options.metrics))
        self.name = f"{options.strategy.name}-{next(_JOB_NUMBERS)}"
        self._saved_records: dict[str, int] = {}  # checkpoint path -> records of the history it includes
        self._local_weights: list | None = None  # the trained weights, kept when the kernel's connection is replaced
        self._loss_source = loss
        # set by _setup, once the job's turn comes (a queued job has touched no task yet)
        self._epoch: int | None = None
        self._ps_names: list[str] = []
        self._worker_devices: list[str] = []
        self._fns = None
        self._set_up = threading.Event()  # _setup finished (or failed: then ``error`` says why)
        self._ended = threading.Event()  # the job is finished, failed or cancelled
        self._setup_error: BaseException | None = None  # raised as it came (a mistake in the user's functions)
        self._dtype_policy = _caller_dtype_policy()  # Keras keeps it per thread; set up runs in the job's thread
        self._recorder = StepRecorder(cluster.telemetry if options.telemetry else None, self.name,
                                      cluster.clock_offsets() if options.telemetry else None)
        self._started = time.time()
        self._loop = EpochLoop(self, fit)  # epochs, validation, Keras callbacks, TensorBoard
        self._thread = threading.Thread(target=drive, args=(self,), name=f"workbench-job-{self.name}", daemon=True)

    # -- public ------------------------------------------------------------------------------

    def start(self, queue: bool = True) -> Job:
        """Submit the job to its cluster: it begins now if the cluster is free, else waits its turn in ``queued``
        (with ``queue=False`` a busy cluster raises ``ClusterStateError`` instead)."""
        if not self.cluster.job_queue.submit(self, queue=queue):
            self._report_progress()  # queued: the dashboards and the panel list it under the running job
        return self

    def _begin(self) -> None:
        """The job's turn (``JobQueue``): set up and train in the job's own thread."""
        if self.state != QUEUED:  # cancelled while it waited
            self.cluster.job_queue.ended(self)
            return
        self.state = RUNNING
        self._started = time.time()
        self._report_progress()
        self._thread.start()

    def wait_set_up(self, timeout: float | None = None) -> None:
        """Block until the job's set-up is done (its variables exist); raise the set-up's error if it failed.

        ``timeout`` (default: the wait for re-hosted tasks plus ``step_timeout``, the longest a remote call may
        take) ends the wait with a ``TimeoutError`` that says the set-up goes on; an interrupt ends it too.
        """
        timeout = TASKS_READY_SECONDS + self.options.recovery.step_timeout if timeout is None else timeout
        wait_for_event(self._set_up, timeout, self._interrupted,
                       lambda: f"{self.describe()} is still setting up after {timeout:.0f} s (building the model and its "
                               "variables on the tasks): check cluster.status(); job.stop() drops it.")
        if self._setup_error is not None:
            raise self._setup_error

    def describe(self) -> str:
        """One line: name, state, steps (``job async-ps-3 (running, 120/3000 steps)``)."""
        total = self.options.steps - self.start_step
        ahead = ""
        if self.state == QUEUED:
            current = self.cluster.job_queue.current
            ahead = f", after {current.name}" if current is not None and current is not self else ""
        if self._loop.stopped_early:
            ahead = f", stopped early by a callback after epoch {self._loop.epoch}"
        return f"job {self.name} ({self.state}, {self.steps_done}/{total} steps{ahead})"

    def _report_progress(self, state: str | None = None) -> None:
        moved = self._bytes_per_step()
        self._recorder.progress(self.steps_done, self.options.steps - self.start_step, state or self.state, self._started,
                                self.options.strategy.name, [r.name for r in self._workers], self.options.strategy.transfer,
                                moved["total"] if moved else 0)

    @property
    def info(self) -> dict:
        """How the job is laid out: strategy, batches, devices, variable placement."""
        return {
            "strategy": self.options.strategy.name,
            "steps": self.options.steps,
            "start_step": self.start_step,
            "global_batch_size": self.options.batch_size,
            "per_worker_batch_size": self.options.per_worker_batch,
            "workers": [r.name for r in self._workers],
            "backup_workers": self.options.strategy.backup_workers,
            "gradients_per_step": self.options.strategy.gradients_per_step(len(self._workers)),
            "ps_bytes": dict(self.placer.loads) if self.placer else {},
            "partitioned": dict(self.placer.partitioned) if self.placer else {},
            "checkpoint_dir": self.options.checkpoint.directory if self.options.checkpoint else None,
            "recover": self.options.recovery.rehost,
            "transfer": self.options.strategy.transfer,
            "bytes_per_step": self._bytes_per_step(),
        }

    def _bytes_per_step(self) -> dict | None:
        """What one step of one worker moves between it and the ps tasks (None: the strategy has no ps)."""
        return None

    @property
    def timeline(self):
        """The job's step timeline (``JobTimeline``): ``job.timeline.save("job.json")`` writes a trace that
        ui.perfetto.dev or chrome://tracing open, tasks as processes, devices as threads, faults as instants."""
        from ...telemetry.step_trace import JobTimeline

        return JobTimeline(self.cluster.telemetry, self.name)

    @property
    def history(self) -> list[dict]:
        """One record per step: step, loss, metrics, worker(s), worker-side start/end time, examples/s.

        ``recovery`` counts the restores from a checkpoint before the step ran: where it changes, the job
        went back to a checkpoint (``faults`` says when and why; steps run before and then undone are
        not listed).
        """
        with self._lock:
            return sorted((dict(r) for r in self._history), key=lambda r: r["step"])

    @property
    def faults(self) -> list[dict]:
        """Each task lost, hung or straggling during the job, and what was done: task, kind, detected (time),
        step, action (re-hosted, restored, dropped, waited, failed), recovered (time), seconds, resumed_from,
        redone (steps run again after a restore), count (stragglers), detail."""
        return [fault.as_dict() for fault in list(self._faults)]

    @property
    def steps_done(self) -> int:
        with self._lock:
            return len(self._history)

    def throughput(self, warmup: int = 0) -> dict[str, float]:
        """Steps/s and examples/s over the steps done, after the first ``warmup`` steps (tracing, caches).

        Measured on the workers' clocks, from the first counted step's start to the last one's end.
        """
        return throughput_of(self.history, warmup)

    def wait(self, timeout: float | None = None) -> Job:
        """Block until the job ends (a queued job: until it ran); raise its error if it failed.

        An interrupt (Jupyter's stop button, Ctrl-C) ends the wait within a fraction of a second and
        leaves the job going on in the background: the ``KeyboardInterrupt`` says so and how to stop it.
        """
        wait_for_event(self._ended, timeout, self._interrupted,
                       lambda: f"{self.describe()} has not ended after {timeout} s; wait longer or job.stop().")
        if self.error is not None:
            raise self.error
        return self

    def _interrupted(self) -> str:
        how = f"cluster.jobs[{self.name!r}].stop()"
        return f"{self.describe()} goes on in the background; {how} stops it"

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the job: a queued one is dropped (``cancelled``); a running one stops after its calls in flight
        (``stopping``, then ``cancelled``), waited for up to ``timeout`` s."""
        if self.cluster.job_queue.cancel(self) or self.state == QUEUED:
            self._end(CANCELLED)
            self._report_progress()
            return
        if self.state in ENDED:
            return
        self.state = STOPPING
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout)

    cancel = stop

    def _end(self, state: str) -> None:
        self.state = state
        requests = self._scales.take()
        if requests:  # the cluster scaled in the job's last steps: nothing was left to follow with
            leaving = {name for names, _done, _asked in requests for name in names}
            before = [r.name for r in self._workers]
            after = [r.name for r in self.cluster.tasks if r.job == "worker" and r.name not in leaving]
            if after != before:
                self._scales.record(requests, before, after, time.time(), 0.0, self.start_step + self.steps_done,
                                    "after its last step", self.name)
        self._set_up.set()
        self._ended.set()
        for _leaving, done, _asked in requests:  # an ended job uses no worker: scale() goes on
            done.set()

    # -- the cluster scaled while the job trains (Cluster.scale -> TaskHosting.scale_workers) -----------

    @property
    def events(self) -> list[dict]:
        """Each change of the job's workers while it trained (``cluster.scale``): ``kind`` ("scale"), ``time`` (when
        the old workers' last calls were back), ``step`` (steps done then), ``workers`` (from then on), ``joined``,
        ``left``, ``drain_seconds`` (from the scale's request until those calls were back) and ``pause_seconds`` (from
        then until the new workers' first calls: rebuilding the input pipelines and the connection)."""
        return self._scales.events()

    def check_rescale(self, workers: int) -> None:
        """Raise (``ClusterStateError``, ``ConfigurationError``) if this job cannot follow a scale to ``workers``."""

    def rescale(self, leaving: tuple[str, ...] = (), timeout: float | None = None) -> None:
        """The cluster's workers changed: follow at the next step boundary (new workers join the next run).

        With ``leaving`` (workers about to stop), return once the job no longer uses them: its calls on them came
        back and its next run goes on without them (``ClusterStateError`` if that takes over ``timeout``, by default
        ``step_timeout`` plus a minute; the request is then withdrawn and the workers stay).
        """
        if self.state in ENDED or self.state == QUEUED:
            return  # a queued job takes the cluster's workers when its turn comes
        if leaving and threading.current_thread() is self._thread:
            raise ClusterStateError(f"cannot remove workers from inside {self.describe()} (a callback): the job would "
                                    "wait for itself. Scale from the notebook while it trains, or after job.wait().")
        self._scales.ask(tuple(leaving), self.options.recovery.step_timeout + 60.0 if timeout is None else timeout,
                         self.describe)

    def rescale_pending(self) -> bool:
        """Whether a scale waits to be followed (a run then stops handing out work and ends when its calls are back)."""
        return self._scales.pending()

    def evaluate(self, data: Callable | None = None, batch_size: int = 256) -> dict[str, float]:
        """Loss and metrics of the trained variables over one pass of ``data``.

        ``data(ctx)`` (default: the training data function) runs on ``worker:0``. A ``tf.data.Dataset``
        of ``(features, labels)``, batched or one example each, runs in this kernel on ``job.model``.
        """
        self.cluster.job_queue.require_idle(f"evaluate job {self.name}")
        if is_dataset(data):
            return evaluate_dataset(self.model, data, self._loss_fn, resolve_metrics(self.options.metrics),
                                    self._example_rank(), batch_size)
        check_evaluation_data(data)
        return self._evaluate_data_function(data or self._data, batch_size)

    # -- what the epoch loop asks (fit/loop.py) -----------------------------------------------------

    @property
    def model(self):
        """A local Keras model (in this kernel, no cluster needed) holding the trained weights."""
        raise NotImplementedError(f"{type(self).__name__} says how its model is built")

    def _evaluate_on(self, model, dataset, steps: int | None = None) -> dict[str, float]:
        cached = getattr(self, "_dataset_batch", None)
        if cached is None or cached[0] is not model:
            cached = self._dataset_batch = (model, batch_function(model, self._loss_fn, resolve_metrics(self.options.metrics)))
        return evaluate_dataset(model, dataset, self._loss_fn, resolve_metrics(self.options.metrics), self._example_rank(),
                                self.options.batch_size, cached[1], steps)

    @property
    def keras_history(self):
        """The job's ``keras.callbacks.History``, as ``model.fit`` returns it: ``keras_history.history["loss"]`` has
        one plain float per epoch (the mean over its steps), ``val_*`` where validated; ``.epoch`` lists the epochs."""
        return self._loop.history

    @property
    def epoch(self) -> int:
        """The current epoch (0-based), or the last one once the job ended."""
        return self._loop.epoch

    @property
    def stopped_early(self) -> bool:
        """A callback set ``model.stop_training`` (``EarlyStopping``, ``TerminateOnNaN``): the job finished before
        its last step, at the end of epoch ``job.epoch``."""
        return self._loop.stopped_early

    # -- the kernel's connection ---------------------------------------------------------------

    def settle(self, timeout: float) -> str | None:
        """Wait up to ``timeout`` s for the job to end; say what runs if it still does (``connection``).

        A job that handed the cluster on (``job_queue.ended``) counts as ended although its thread is still
        waking its waiters: the next job, started from that very thread, connects while it does.
        """
        if self._thread.is_alive() and self.state not in ENDED:
            self._thread.join(timeout)
        return f"job {self.name} runs" if self._thread.is_alive() and self.state not in ENDED else None

    def __repr__(self) -> str:
        return f"<workbench.Job {self.name} {self.state}: {self.steps_done}/{self.options.steps - self.start_step} steps>"

    # -- the driver --------------------------------------------------------------------------

    def _trim_engines(self) -> None:
        """Return what the job's engines freed to the system (a memory-capped container counts it); no waiting."""
        from ...cluster.machine.memory import trim_memory

        try:
            alive = set(self.cluster.client.ids)
            engines = [r.engine_id for r in self.cluster.tasks if r.engine_id in alive]
            if engines:
                self.cluster.client[engines].apply_async(trim_memory)
        except Exception:  # noqa: BLE001 - an optimisation: a stopped cluster or a lost engine needs none
            pass

    def _release_training(self) -> None:
        """The job ended (its own thread, before its waiters wake): let go of what only training needed, keep what
        its user can still ask (history, events, evaluate, model, the timeline). Each strategy adds its own."""
        self._dataset_batch = None

    # -- records --------------------------------------------------------------------------------

    def missing_steps(self) -> list[int]:
        """The steps still to run, in order: none recorded yet, or undone by a restore."""
        with self._lock:
            done = {r["step"] for r in self._history}
        return [step for step in range(self.start_step, self.options.steps) if step not in done]

    def record_call(self, records: list[dict], accept: Callable[[], bool] | None = None) -> bool:
        """The steps of one remote call that came back, in every strategy: into the history (the newest is the
        callbacks' batch end) as one change, to the dashboards, then a checkpoint if one is due (which may raise
        ``TaskLost``). ``accept()``, called under the job's lock, may refuse them (False): a call given up on."""
        with self._lock:
            if accept is not None and not accept():
                return False
            for i, record in enumerate(records):
                self._history.append(record)
                self._loop.step_done(record, i == len(records) - 1)
        for record in records:
            self._recorder.step_done(record)
        if self._cadence is not None:
            self._cadence.steps_recorded(self)
        return True

    def step_record(self, step: int, loss: float, metrics, worker: str, start: float, end: float, examples: int,
                    **extra) -> dict:
        """One step's record, for ``record_call``: plain numbers, named by the job's metrics."""
        return make_step_record(step, loss, metrics, self.metric_names, worker, start, end, examples, self.recoveries, **extra)
