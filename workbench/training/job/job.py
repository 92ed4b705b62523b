"""A training job on a cluster (``wb.Job``): its life from submission to its end, whatever the strategy.

The job waits its turn in the cluster's queue, runs in a thread of its own (``driver.py``), keeps
one record per step (``history``), the faults of its tasks (``faults``, from ``recovery.py``) and
the checkpoints due, and reports progress to the dashboards. What depends on the strategy is its
``trainer``'s (the ``Trainer`` protocol, ``trainer.py``), which the job holds: ``PsTrainer``
(``strategies/ps/``: variables on the ps tasks, loops in ``async_ps.py`` and ``sync_ps/``),
``PlacedTrainer`` (``placed.py``), ``AllReduceTrainer`` (``allreduce/``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

from ...cluster.jobs import CANCELLED, ENDED, QUEUED, RUNNING, STOPPING
from ...errors import ClusterStateError
from ...telemetry.recorder import StepRecorder
from ..fit.evaluation import batch_function, check_evaluation_data, evaluate_dataset, is_dataset
from ..fit.loop import EpochLoop, FitArguments
from ..modelling.losses import resolve_loss, resolve_metrics
from ..options import TrainOptions
from .driver import TASKS_READY_SECONDS, drive
from .records import layout_of, make_step_record, throughput_of
from .recovery import Supervisor
from .scaling import Scales
from .trainer import JobInputs, Trainer
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

    The life of a job (queue, thread, records, faults, checkpoints due, waiting and stopping) is here, the
    same for every strategy; what depends on the strategy is its ``trainer`` (``job/trainer.py``). The job's
    thread, its trainer and the epoch loop share its working parts: ``inputs`` (what ``wb.train`` was
    given), ``workers`` (the task records it trains on), ``lock`` (guards the history and a run's
    bookkeeping), ``loop`` (epochs, validation, callbacks), ``recorder`` (the dashboards' telemetry) and
    ``supervisor`` (its tasks' faults, while it runs).
    """

    def __init__(self, cluster, inputs: JobInputs, options: TrainOptions, trainer: Callable[[Job], Trainer],
                 fit: FitArguments | None = None):
        self.cluster = cluster
        self.options = options
        self.inputs = inputs
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._history: list[dict] = []
        self.state = QUEUED
        self.error: BaseException | None = None
        self.dropped_gradients = 0
        self.lost_workers: list[str] = []  # workers the job lost and finished without
        self.last_checkpoint: str | None = None
        self.start_step = 0
        self.recoveries = 0  # restores from a checkpoint so far (a ps, or an all-reduce worker, was lost)
        self.faults_found: list = []  # the Supervisor's Fault objects (``faults`` gives them as dicts)
        self.cadence = None  # when the current run's steps are due a save (checkpoints.Cadence, set by the driver)
        self._scales = Scales(self.lock)  # cluster.scale while it trains: requests to follow, changes made (events)
        self.supervisor: Supervisor | None = None  # set by the driver while the job runs
        self.workers = [r for r in cluster.tasks if r.job == "worker"]
        self.metric_names = list(resolve_metrics(options.metrics))
        self.name = f"{options.strategy.name}-{next(_JOB_NUMBERS)}"
        self._saved_records: dict[str, int] = {}  # checkpoint path -> records of the history it includes
        self._loss_fn = None  # resolve_loss(inputs.loss), made on first use
        self._dataset_batch = None  # (model, its evaluation step) for validation data given as a dataset
        self.set_up_done = threading.Event()  # the trainer's set-up finished (or failed: ``setup_error`` says why)
        self._ended = threading.Event()  # the job is finished, failed or cancelled
        self.setup_error: BaseException | None = None  # raised as it came (a mistake in the user's functions)
        self.dtype_policy = _caller_dtype_policy()  # Keras keeps it per thread; set up runs in the job's thread
        self.recorder = StepRecorder(cluster.telemetry if options.telemetry else None, self.name,
                                     cluster.clock_offsets() if options.telemetry else None)
        self._started = time.time()
        self.trainer = trainer(self)  # touches no task: a queued job waits its turn
        self.loop = EpochLoop(self, fit)  # epochs, validation, Keras callbacks, TensorBoard
        self._thread = threading.Thread(target=drive, args=(self,), name=f"workbench-job-{self.name}", daemon=True)

    # -- public ------------------------------------------------------------------------------

    def start(self, queue: bool = True) -> Job:
        """Submit the job to its cluster: it begins now if the cluster is free, else waits its turn in ``queued``
        (with ``queue=False`` a busy cluster raises ``ClusterStateError`` instead)."""
        if not self.cluster.job_queue.submit(self, queue=queue):
            self.report_progress()  # queued: the dashboards and the panel list it under the running job
        return self

    def on_turn(self) -> None:
        """The job's turn came (the cluster's ``JobQueue`` calls this): set up and train in the job's own thread."""
        if self.state != QUEUED:  # cancelled while it waited
            self.cluster.job_queue.ended(self)
            return
        self.state = RUNNING
        self._started = time.time()
        self.report_progress()
        self._thread.start()

    def wait_set_up(self, timeout: float | None = None) -> None:
        """Block until the job's set-up is done (its variables exist); raise the set-up's error if it failed.

        ``timeout`` (default: the wait for re-hosted tasks plus ``step_timeout``, the longest a remote call may
        take) ends the wait with a ``TimeoutError`` that says the set-up goes on; an interrupt ends it too.
        """
        timeout = TASKS_READY_SECONDS + self.options.recovery.step_timeout if timeout is None else timeout
        wait_for_event(self.set_up_done, timeout, self._interrupted,
                       lambda: f"{self.describe()} is still setting up after {timeout:.0f} s (building the model and its "
                               "variables on the tasks): check cluster.status(); job.stop() drops it.")
        if self.setup_error is not None:
            raise self.setup_error

    def describe(self) -> str:
        """One line: name, state, steps (``job async-ps-3 (running, 120/3000 steps)``)."""
        total = self.options.steps - self.start_step
        ahead = ""
        if self.state == QUEUED:
            current = self.cluster.job_queue.current
            ahead = f", after {current.name}" if current is not None and current is not self else ""
        if self.loop.stopped_early:
            ahead = f", stopped early by a callback after epoch {self.loop.epoch}"
        return f"job {self.name} ({self.state}, {self.steps_done}/{total} steps{ahead})"

    def report_progress(self, state: str | None = None) -> None:
        """Tell the dashboards and the panel where the job is now (``state``: the one it is about to take)."""
        moved = self.trainer.bytes_per_step()
        self.recorder.progress(self.steps_done, self.options.steps - self.start_step, state or self.state, self._started,
                               self.options.strategy.name, [r.name for r in self.workers], self.options.strategy.transfer,
                               moved["total"] if moved else 0)

    @property
    def info(self) -> dict:
        """How the job is laid out: strategy, batches, devices, variable placement."""
        return {**layout_of(self), **self.trainer.info()}

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
        with self.lock:
            return sorted((dict(r) for r in self._history), key=lambda r: r["step"])

    @property
    def faults(self) -> list[dict]:
        """Each task lost, hung or straggling during the job, and what was done: task, kind, detected (time),
        step, action (re-hosted, restored, dropped, waited, failed), recovered (time), seconds, resumed_from,
        redone (steps run again after a restore), count (stragglers), detail."""
        return [fault.as_dict() for fault in list(self.faults_found)]

    @property
    def steps_done(self) -> int:
        with self.lock:
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
        if self.state in ENDED:  # the interrupt came as the job ended: nothing goes on
            return f"{self.describe()} ended as the wait was interrupted"
        how = f"cluster.jobs[{self.name!r}].stop()"
        return f"{self.describe()} goes on in the background; {how} stops it"

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the job: a queued one is dropped (``cancelled``); a running one stops after its calls in flight
        (``stopping``, then ``cancelled``), waited for up to ``timeout`` s."""
        if self.cluster.job_queue.cancel(self) or self.state == QUEUED:
            self.mark_ended(CANCELLED)
            self.report_progress()
            return
        if self.state in ENDED:
            return
        self.state = STOPPING
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout)

    cancel = stop

    @property
    def stop_requested(self) -> bool:
        """``stop()`` was called: the job's run ends after its calls in flight."""
        return self._stop.is_set()

    def mark_ended(self, state: str) -> None:
        """The job is over (its thread, once it handed the cluster on; ``stop`` for a queued one): its waiters wake."""
        self.state = state
        requests = self._scales.take()  # the cluster scaled in the job's last steps: nothing was left to follow with
        self._scales.note_after_end(requests, self)
        self.set_up_done.set()
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
        self.trainer.check_rescale(workers)

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

    def adopt_workers(self, drained: float) -> None:
        """At a step boundary (no call in flight, the job's thread): follow the scales asked (``trainer.follow_scale``),
        recorded in ``events``; each scale's wait ends once it is done (or failed: the job's error says why)."""
        self._scales.follow(self, drained)

    def evaluate(self, data: Callable | None = None, batch_size: int = 256) -> dict[str, float]:
        """Loss and metrics of the trained variables over one pass of ``data``.

        ``data(ctx)`` (default: the training data function) runs on ``worker:0``. A ``tf.data.Dataset``
        of ``(features, labels)``, batched or one example each, runs in this kernel on ``job.model``.
        """
        self.cluster.job_queue.require_idle(f"evaluate job {self.name}")
        if is_dataset(data):
            return evaluate_dataset(self.model, data, self.loss_fn, resolve_metrics(self.options.metrics),
                                    self.trainer.example_rank(), batch_size)
        check_evaluation_data(data)
        return self.trainer.evaluate(data or self.inputs.data, batch_size)

    @property
    def model(self):
        """A local Keras model (in this kernel, no cluster needed) holding the trained weights."""
        return self.trainer.local_model()

    @property
    def loss_fn(self):
        """The loss ``wb.train`` was given, as a Keras loss function."""
        if self._loss_fn is None:
            self._loss_fn = resolve_loss(self.inputs.loss)
        return self._loss_fn

    def validate_dataset(self, model, dataset, steps: int | None = None) -> dict[str, float]:
        """Loss and metrics of ``model`` (in this kernel) over ``dataset``: validation data given as a dataset."""
        cached = self._dataset_batch
        if cached is None or cached[0] is not model:
            cached = self._dataset_batch = (model, batch_function(model, self.loss_fn, resolve_metrics(self.options.metrics)))
        return evaluate_dataset(model, dataset, self.loss_fn, resolve_metrics(self.options.metrics),
                                self.trainer.example_rank(), self.options.batch_size, cached[1], steps)

    @property
    def keras_history(self):
        """The job's ``keras.callbacks.History``, as ``model.fit`` returns it: ``keras_history.history["loss"]`` has
        one plain float per epoch (the mean over its steps), ``val_*`` where validated; ``.epoch`` lists the epochs."""
        return self.loop.history

    @property
    def epoch(self) -> int:
        """The current epoch (0-based), or the last one once the job ended."""
        return self.loop.epoch

    @property
    def stopped_early(self) -> bool:
        """A callback set ``model.stop_training`` (``EarlyStopping``, ``TerminateOnNaN``): the job finished before
        its last step, at the end of epoch ``job.epoch``."""
        return self.loop.stopped_early

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

    def release_remote(self) -> None:
        """The kernel connects elsewhere (``connection``): what lived on the tasks goes; ``model`` stays readable."""
        self.trainer.release_remote()

    def release_training(self) -> None:
        """The job ended (its own thread, before its waiters wake): let go of what only training needed, keep what
        its user can still ask (history, events, evaluate, model, the timeline)."""
        self._dataset_batch = None
        self.trainer.release()

    # -- records and checkpoints -------------------------------------------------------------------

    def missing_steps(self) -> list[int]:
        """The steps still to run, in order: none recorded yet, or undone by a restore."""
        with self.lock:
            done = {r["step"] for r in self._history}
        return [step for step in range(self.start_step, self.options.steps) if step not in done]

    def record_call(self, records: list[dict], accept: Callable[[], bool] | None = None) -> bool:
        """The steps of one remote call that came back, in every strategy: into the history (the newest is the
        callbacks' batch end) as one change, to the dashboards, then a checkpoint if one is due (which may raise
        ``TaskLost``). ``accept()``, called under the job's lock, may refuse them (False): a call given up on."""
        with self.lock:
            if accept is not None and not accept():
                return False
            for i, record in enumerate(records):
                self._history.append(record)
                self.loop.step_done(record, i == len(records) - 1)
        for record in records:
            self.recorder.step_done(record)
        if self.cadence is not None:
            self.cadence.steps_recorded(self)
        return True

    def step_record(self, step: int, loss: float, metrics, worker: str, start: float, end: float, examples: int,
                    **extra) -> dict:
        """One step's record, for ``record_call``: plain numbers, named by the job's metrics."""
        return make_step_record(step, loss, metrics, self.metric_names, worker, start, end, examples, self.recoveries, **extra)

    def save_checkpoint(self) -> None:
        """Write a checkpoint of the variables now (the job's thread, between calls): ``last_checkpoint``."""
        with self.lock:
            done = len(self._history)  # the records (in the order they came) that this checkpoint includes
        self.last_checkpoint = self.trainer.save(self.start_step + done)
        self._saved_records[self.last_checkpoint] = done

    def restore_checkpoint(self) -> int:
        """The tasks it lost are back: the trainer builds the variables again from ``last_checkpoint``; the history
        keeps the records that checkpoint includes (the others run again). Returns how many were undone."""
        kept = self._saved_records.get(self.last_checkpoint, 0)  # 0 for the checkpoint the job resumed from
        self.trainer.restore(self.last_checkpoint, self.start_step + kept)
        self.loop.model_replaced()
        with self.lock:
            undone = len(self._history) - kept
            self._history = self._history[:kept]
        return undone
