"""A training job on a cluster: set-up in the kernel, steps on the workers, variables on the ps tasks.

The kernel schedules; it never carries the data or the per-step parameters. Each worker has a
thread in the kernel bound to it, so the job knows which worker ran each step, gives each worker
its own shard of the data, and can treat the workers differently (backup workers in sync-ps).
The loops themselves are in ``async_ps.py`` and ``sync_ps.py``; what happens when a task fails,
in ``recovery.py``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .. import native_logs
from ..cluster.health import LOST, RECOVERING, SILENT
from ..cluster.health import RUNNING as RUNNING_TASK
from ..cluster.jobs import CANCELLED, ENDED, FAILED, FINISHED, QUEUED, RUNNING, STOPPING
from ..cluster.process import connection
from ..errors import ClusterStateError, ConfigurationError, ParameterServerLost, TrainingError, WorkbenchError
from ..telemetry.recorder import StepRecorder
from .building import build_model, build_optimizer, seed_initializers, update_where_the_variable_lives
from .data import DataContext, evaluation_dataset, training_dataset
from .evaluation import batch_function, check_evaluation_data, evaluate_dataset, is_dataset, validate_on_workers
from .fit import EpochLoop, FitArguments
from .options import TrainOptions, validate
from .packing import packing_for
from .placement import PsPlacer, optimizer_targets, shards_of, tf_variable
from .recovery import Supervisor, TaskLost
from .steps import StepFunctions, resolve_loss, resolve_metrics
from .workers import compute_device, input_device

# Errors that mean "a task went away", as opposed to a bug in the model or data functions.
_INFRASTRUCTURE_ERRORS = ("UnavailableError", "AbortedError", "CancelledError", "DeadlineExceededError", "InternalError")
PS_CONFIRM_SECONDS = 1.0  # how long a lost connection is re-checked for a ps that is going away
TASKS_READY_SECONDS = 120.0  # how long a job's start waits for a task being re-hosted
MAX_RESTORES = 10  # restores from a checkpoint one job may do before it gives up (a task that keeps dying)
_JOB_NUMBERS = itertools.count(1)


def _caller_dtype_policy():
    import keras

    return keras.config.dtype_policy()


def _use_dtype_policy(policy) -> None:
    """Keras's global dtype policy (mixed precision) lives per thread: the job's thread takes its caller's."""
    import keras

    keras.config.set_dtype_policy(policy)


def is_infrastructure_error(exc: BaseException) -> bool:
    """An error that says a task went away (or cannot be reached), not a bug in the model or data."""
    return type(exc).__name__ in _INFRASTRUCTURE_ERRORS


class Job:
    """A training job on a cluster. Returned by ``wb.train``.

    A cluster runs one job at a time (``cluster.jobs`` lists them): a job submitted while another runs
    waits in state ``queued`` and begins when the cluster is free. ``state`` is one of ``queued``,
    ``running``, ``stopping``, ``finished``, ``failed``, ``cancelled``.

    ``wait()`` blocks until it ends; ``stop()`` stops it (or ``cancel()``, which also drops a queued one);
    ``history`` holds one record per step; ``evaluate(data)`` runs on the trained variables; ``model``
    is a local Keras model with the trained weights; ``faults`` lists the tasks lost, hung or
    straggling during the job and what was done about it.
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
        self._supervisor: Supervisor | None = None
        self.placer: PsPlacer | None = None  # ps strategies: where each variable went
        self._workers = [r for r in cluster.tasks if r.job == "worker"]
        self.metric_names = list(resolve_metrics(options.metrics))
        self.name = f"{options.strategy}-{next(_JOB_NUMBERS)}"
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
        self._thread = threading.Thread(target=self._drive, name=f"workbench-job-{self.name}", daemon=True)

    def _setup(self, cluster, model: Any, data: Callable, loss: Any, optimizer: Any, options: TrainOptions) -> None:
        """Parameter-server strategies: variables on the ps tasks, steps driven from this kernel."""
        self._epoch = connection.connect(cluster, holder=self)
        ps_tasks = [r for r in cluster.tasks if r.job == "ps"]
        if not ps_tasks:
            raise ConfigurationError(
                f"strategy={options.strategy!r} keeps the variables on ps tasks, and cluster {cluster.name!r} has none: "
                "start it with ps=1 or more."
            )
        self._ps_devices = [f"{r.task.device}/device:CPU:0" for r in ps_tasks]
        self._ps_names = [r.name for r in ps_tasks]
        self._worker_devices = [compute_device(r) for r in self._workers]  # a worker's GPU where it has one
        self._seed = self._probe_data(data, options)
        self._loss_fn = resolve_loss(loss)
        self._build_variables()
        self._setup_checkpoints(resume=options.resume)
        self._iterators = [self._make_iterator(i) for i in range(len(self._worker_devices))]

    def _build_variables(self) -> None:
        """The model, the optimizer and the step counter, with their variables on the ps tasks; the step functions."""
        import tensorflow as tf

        self.placer = PsPlacer(self._ps_devices, self.options.partition_bytes)
        with tf.variable_creator_scope(self.placer):
            self._model = build_model(self._model_source, tf.zeros(self._example_shape, self._example_dtype))
            targets, splits = optimizer_targets(self._model.trainable_variables)
            self._optimizer = build_optimizer(self._optimizer_source)
            update_where_the_variable_lives(self._optimizer)
            self._optimizer.build(targets)
            with tf.device(self._ps_devices[0]):
                self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="workbench_step")
        self._fns = StepFunctions(self._model, self._optimizer, self._loss_fn, resolve_metrics(self.options.metrics),
                                  targets, splits, packing_for(self._model, targets, self.options.transfer))
        if self.options.transfer != "fp32" and self._fns.packing is None:
            raise ConfigurationError(
                f"transfer={self.options.transfer!r} needs a model whose trainable variables are all Keras "
                "variables (it runs on the received values through keras.StatelessScope); this one has others. "
                "Build it from Keras layers, or leave transfer='fp32'.")

    def _probe_data(self, data: Callable, options: TrainOptions) -> int:
        """Seed Keras, learn the example shape from the data function; return the data seed."""
        seed = 0 if options.seed is None else options.seed
        if options.seed is not None:
            seed_initializers(options.seed)
        probe = data(DataContext(0, options.num_workers, options.per_worker_batch, seed))
        example = training_dataset(lambda _ctx: probe, DataContext(0, 1, 1, seed)).element_spec[0]
        self._example_shape, self._example_dtype = [1, *example.shape[1:]], example.dtype
        return seed

    def _setup_checkpoints(self, resume: bool) -> None:
        import tensorflow as tf

        self._checkpoint = None
        if self.options.checkpoint_dir:
            if self.placer is not None and self.placer.partitioned:
                # a Keras model cannot checkpoint a partitioned variable itself: save the shards
                weights = [shard for w in self._model.weights for shard in shards_of(w)]
                self._checkpoint = tf.train.Checkpoint(weights=weights, optimizer=self._optimizer, step=self._step)
            else:
                self._checkpoint = tf.train.Checkpoint(model=self._model, optimizer=self._optimizer, step=self._step)
            with tf.device(self._ps_devices[0]):
                self._checkpoint.save_counter  # noqa: B018 - made now, on the ps (see _save)
            self._manager = tf.train.CheckpointManager(self._checkpoint, self.options.checkpoint_dir, max_to_keep=3)
            if resume:
                self._restore(self._manager.latest_checkpoint)
                self.start_step = int(self._step.numpy())

    def _restore(self, path: str) -> None:
        self._checkpoint.restore(path).expect_partial()
        self.last_checkpoint = path

    def _make_iterator(self, index: int):
        """The input pipeline of worker ``index``, built and run on that worker."""
        import tensorflow as tf

        ctx = DataContext(index, len(self._worker_devices), self.options.per_worker_batch, self._seed)
        make = tf.function(lambda: training_dataset(self._data, ctx), autograph=False).get_concrete_function()
        with tf.device(input_device(self._workers[index])):
            return iter(make())

    def rebuild_worker(self, index: int) -> None:
        """Worker ``index`` was re-hosted: what the job kept on it (its input pipeline) is made again there."""
        self._iterators[index] = self._make_iterator(index)
        if getattr(self, "_fns", None) is not None:
            self._fns.forget_worker(self._worker_devices[index])

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
        timeout = TASKS_READY_SECONDS + self.options.step_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        try:
            while not self._set_up.wait(0.2):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.describe()} is still setting up after {timeout:.0f} s (building the model "
                                       "and its variables on the tasks): check cluster.status(); job.stop() drops it.")
        except KeyboardInterrupt:
            raise KeyboardInterrupt(self._interrupted()) from None
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
                                self.options.strategy, [r.name for r in self._workers], self.options.transfer,
                                moved["total"] if moved else 0)

    @property
    def info(self) -> dict:
        """How the job is laid out: strategy, batches, devices, variable placement."""
        return {
            "strategy": self.options.strategy,
            "steps": self.options.steps,
            "start_step": self.start_step,
            "global_batch_size": self.options.batch_size,
            "per_worker_batch_size": self.options.per_worker_batch,
            "workers": [r.name for r in self._workers],
            "backup_workers": self.options.backup_workers,
            "gradients_per_step": self.options.required_gradients if self.options.strategy == "sync-ps" else None,
            "ps_bytes": dict(self.placer.loads) if self.placer else {},
            "partitioned": dict(self.placer.partitioned) if self.placer else {},
            "checkpoint_dir": self.options.checkpoint_dir,
            "recover": self.options.recover,
            "transfer": self.options.transfer,
            "bytes_per_step": self._bytes_per_step(),
        }

    def _bytes_per_step(self) -> dict | None:
        """What one step of one worker moves between it and the ps tasks: parameters in, gradients out."""
        packing = getattr(getattr(self, "_fns", None), "packing", None)
        if packing is None:
            return None
        each = packing.bytes_per_transfer()
        return {"parameters": each, "gradients": each, "total": 2 * each}

    @property
    def timeline(self):
        """The job's step timeline (``JobTimeline``): ``job.timeline.save("job.json")`` writes a trace that
        ui.perfetto.dev or chrome://tracing open, tasks as processes, devices as threads, faults as instants."""
        from ..telemetry.step_trace import JobTimeline

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
        records = sorted(self.history, key=lambda r: r["end"])[warmup:]
        if len(records) < 2:
            raise TrainingError(f"throughput needs at least 2 steps after warmup={warmup}; the job has "
                                f"{self.steps_done}: train longer or lower warmup.")
        seconds = max(records[-1]["end"] - min(r["start"] for r in records), 1e-9)
        return {"steps_per_s": len(records) / seconds, "examples_per_s": sum(r["examples"] for r in records) / seconds,
                "seconds": seconds, "steps": len(records)}

    def wait(self, timeout: float | None = None) -> Job:
        """Block until the job ends (a queued job: until it ran); raise its error if it failed.

        An interrupt (Jupyter's stop button, Ctrl-C) ends the wait within a fraction of a second and
        leaves the job going on in the background: the ``KeyboardInterrupt`` says so and how to stop it.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._ended.is_set():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{self.describe()} has not ended after {timeout} s; wait longer or job.stop().")
                self._ended.wait(0.2 if left is None else min(0.2, left))  # short waits: an interrupt gets through
        except KeyboardInterrupt:
            raise KeyboardInterrupt(self._interrupted()) from None
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
        self._set_up.set()
        self._ended.set()

    def evaluate(self, data: Callable | None = None, batch_size: int = 256) -> dict[str, float]:
        """Loss and metrics of the trained variables over one pass of ``data``.

        ``data(ctx)`` (default: the training data function) runs on ``worker:0``. A ``tf.data.Dataset``
        of ``(features, labels)``, batched or one example each, runs in this kernel on ``job.model``.
        """
        self.cluster.job_queue.require_idle(f"evaluate job {self.name}")
        if is_dataset(data):
            return self._evaluate_here(data, batch_size)
        check_evaluation_data(data)
        return self._evaluate_data_function(data or self._data, batch_size)

    def _evaluate_data_function(self, data: Callable, batch_size: int) -> dict[str, float]:
        """One pass of ``data(ctx)`` on ``worker:0``, on the trained variables where they live."""
        import tensorflow as tf

        connection.check_epoch(self._epoch, "this job")
        seed = 0 if self.options.seed is None else self.options.seed
        self._fns.build_evaluate(tf.autograph.experimental.do_not_convert(lambda: evaluation_dataset(data, batch_size, seed)))
        with tf.device(self._worker_devices[0]):
            values, count = self._fns.evaluate()
        values = values.numpy().tolist()
        return {"loss": values[0], **dict(zip(self.metric_names, values[1:])), "examples": int(count.numpy())}

    def _evaluate_here(self, dataset, batch_size: int) -> dict[str, float]:
        return evaluate_dataset(self.model, dataset, self._loss_fn, resolve_metrics(self.options.metrics),
                                self._example_rank(), batch_size)

    def _example_rank(self) -> int:
        return len(self._example_shape)

    # -- what the epoch loop asks (fit.py) -----------------------------------------------------

    def _callback_model(self):
        """The callbacks' model: the job's own, whose variables live on the tasks, compiled like the job (on the
        first ps: its loss tracker's variables too), so that what a callback reads or sets is read or set there."""
        import tensorflow as tf

        model = self._model
        if not getattr(model, "compiled", False):
            with tf.device(self._ps_devices[0]):
                model.compile(optimizer=self._optimizer, loss=self._loss_source, metrics=list(self.options.metrics))
        return model, None

    def _validate(self, data: Any, steps: int | None) -> dict[str, float]:
        """Validation at an epoch's end, on the trained variables where they live: a data function on every
        worker at once (each its share of the batches), a dataset in this kernel."""
        if is_dataset(data):
            return self._evaluate_on(self._model, data, steps)
        return validate_on_workers(self, data, steps)

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

    @property
    def model(self):
        """A local Keras model (in this kernel, no cluster needed) holding the trained weights."""
        import tensorflow as tf

        weights = self._local_weights
        if weights is None:
            connection.check_epoch(self._epoch, "this job")
            weights = self._read_weights()
        with tf.device("/job:localhost/replica:0/task:0/device:CPU:0"):
            local = build_model(self._model_source, tf.zeros(self._example_shape, self._example_dtype))
        local.set_weights(weights)
        return local

    def _read_weights(self) -> list:
        import tensorflow as tf

        return [tf.convert_to_tensor(tf_variable(w)).numpy() for w in self._model.weights]

    # -- the kernel's connection ---------------------------------------------------------------

    def settle(self, timeout: float) -> str | None:
        """Wait up to ``timeout`` s for the job to end; say what runs if it still does (``connection``).

        A job that handed the cluster on (``job_queue.ended``) counts as ended although its thread is still
        waking its waiters: the next job, started from that very thread, connects while it does.
        """
        if self._thread.is_alive() and self.state not in ENDED:
            self._thread.join(timeout)
        return f"job {self.name} runs" if self._thread.is_alive() and self.state not in ENDED else None

    def release_remote(self) -> None:
        """The kernel connects elsewhere: keep the trained weights here (``job.model``), drop what lived on the tasks."""
        if self._local_weights is None and getattr(self, "_model", None) is not None:
            try:
                self._local_weights = self._read_weights()
            except Exception:  # noqa: BLE001 - the tasks are gone (a stopped cluster): job.model then says so
                pass
        for name in ("_model", "_optimizer", "_step", "_fns", "_iterators", "_checkpoint", "_manager"):
            if hasattr(self, name):
                setattr(self, name, None)

    def __repr__(self) -> str:
        return f"<workbench.Job {self.name} {self.state}: {self.steps_done}/{self.options.steps - self.start_step} steps>"

    # -- the driver --------------------------------------------------------------------------

    def _async_step_options(self) -> dict:
        return {}

    def _run(self) -> None:
        from .async_ps import AsyncRun
        from .sync_ps import SyncRun

        (AsyncRun if self.options.strategy == "async-ps" else SyncRun)(self).run()

    def _drive(self) -> None:
        """The job's thread: set up (now that the cluster is this job's), train, end, hand the cluster on."""
        self._supervisor = Supervisor(self)
        state = FAILED
        try:
            try:
                self._prepare()
                self._loop.begin()  # the callbacks' on_train_begin: a mistake there is raised by wb.train too
            except BaseException as exc:
                self._setup_error = exc if isinstance(exc, Exception) else self._as_error(exc)
                raise
            self._set_up.set()
            self._train_with_recovery()
            stopped = self._stop.is_set()
            self._loop.end(finished=not stopped)  # on_train_end: a callback raising there fails the job
            state = CANCELLED if stopped else FINISHED
        except BaseException as exc:  # noqa: BLE001 - kept for wait() to raise in the caller's thread
            if self._stop.is_set():
                state = CANCELLED  # what a stop interrupted is not the job's error
            else:
                self.error = self._setup_error or self._as_error(exc)
        finally:
            if state != FINISHED:
                self._end_loop_quietly()
            self._supervisor.close()
            self._supervisor = None  # no cycle left: an ended job nobody holds is freed at once, TF state and all
            try:
                self._report_progress(state)
                self._trim_engines()
            finally:
                self.state = state
                self.cluster.job_queue.ended(self)  # before waiters wake: the cluster is free, or the next job's
                self._end(state)

    def _end_loop_quietly(self) -> None:
        """A job that failed or was stopped: no ``on_train_end`` (as ``model.fit`` on an error), files closed."""
        try:
            self._loop.end(finished=False)
        except Exception:  # noqa: BLE001 - the job's own error is the one to report
            pass

    def _prepare(self) -> None:
        """The set-up of ``wb.train``, done when the job's turn comes: the cluster's workers are those of now."""
        cluster, options = self.cluster, self.options
        if cluster.state != "running":
            raise ClusterStateError(f"cannot train on cluster {cluster.name!r}: it is {cluster.state}.")
        self._tasks_ready()
        if options.strategy != "model-parallel":
            self._workers = [r for r in cluster.tasks if r.job == "worker"]
            if len(self._workers) != options.num_workers:  # scaled while the job waited in the queue
                self.options = options = validate(replace(options, num_workers=len(self._workers)))
        _use_dtype_policy(self._dtype_policy)
        self._setup(cluster, self._model_source, self._data, self._loss_source, self._optimizer_source, options)

    def _tasks_ready(self) -> None:
        """Begin on tasks that serve: wait for a re-hosting still under way (the previous job lost a worker and
        ended before it was back), and re-host a task found lost (``recover``) or say which one is."""
        if not self.cluster.settle(TASKS_READY_SECONDS):
            raise ClusterStateError(f"cluster {self.cluster.name!r} was still starting, scaling or re-hosting a task after "
                                    f"{TASKS_READY_SECONDS:.0f} s: check cluster.status().")
        down = [r for r in self.cluster.tasks if r.state in (LOST, RECOVERING)
                or (r.state == RUNNING_TASK and connection.connect_problem(r.address, 2.0))]
        for record in down:
            if not self.options.recover:
                raise ClusterStateError(
                    f"{record.name} of cluster {self.cluster.name!r} is lost ({record.note or 'its server refuses connections'})"
                    f": re-host it with cluster.replace_task({record.name!r}), or train with recover=True.")
            self.cluster.replace_task(record.name, refresh_connection=self._uses_connection)

    def _train_with_recovery(self) -> None:
        while True:
            try:
                self._run()
                if self.options.checkpoint_dir and not self._stop.is_set():
                    self._save_or_lost()
                return
            except TaskLost as lost:
                if not self.options.recover or self._stop.is_set():
                    raise lost.error from None
                self._recover_state(lost)

    def _as_error(self, exc: BaseException) -> BaseException:
        if isinstance(exc, WorkbenchError):
            return exc
        if isinstance(exc, Exception):
            return self._classify(exc, "the job's driver")
        return TrainingError(f"training failed: {type(exc).__name__}: {exc}")

    def _trim_engines(self) -> None:
        """Return what the job's engines freed to the system (a memory-capped container counts it); no waiting."""
        from ..cluster.machine.memory import trim_memory

        try:
            alive = set(self.cluster.client.ids)
            engines = [r.engine_id for r in self.cluster.tasks if r.engine_id in alive]
            if engines:
                self.cluster.client[engines].apply_async(trim_memory)
        except Exception:  # noqa: BLE001 - an optimisation: a stopped cluster or a lost engine needs none
            pass

    # -- checkpoints, faults and records -------------------------------------------------------

    def _save(self) -> None:
        import tensorflow as tf

        with self._lock:
            done = len(self._history)  # the records (in the order they came) that this checkpoint includes
        self._step.assign(self.start_step + done)
        with tf.device(self._ps_devices[0]):
            # TensorFlow saves a checkpoint that spans two tasks with a new tf.function each time, and
            # registers it on every task, holding the GIL: a stopped worker froze the whole kernel. Its
            # bookkeeping ("/cpu:0": the save counter, the object graph) goes on the first ps here, so
            # that with one ps a save is plain ops on that ps; with more, no save starts while a task
            # is silent (checkpoint_due).
            self.last_checkpoint = self._manager.save(checkpoint_number=self.start_step + done)
        self._saved_records[self.last_checkpoint] = done

    def _save_or_lost(self) -> None:
        """``_save()``; a save that found a ps gone raises ``TaskLost`` (the job then restores, or fails)."""
        try:
            self._save()
        except TaskLost:
            raise
        except Exception as exc:  # noqa: BLE001 - classified
            raise self._classify(exc, "the job's checkpointing") from None

    def checkpoint_due(self, next_at: int) -> int:
        """Save if ``next_at`` steps are done (then return the next multiple to save at); else return ``next_at``."""
        every = self.options.checkpoint_every
        if self.options.checkpoint_dir and every and self.start_step + self.steps_done >= next_at:
            if any(r.state == SILENT for r in self.cluster.tasks):
                return next_at  # saving could block on it (see _save): after it answers, or is replaced
            self._save_or_lost()
            return (self.start_step + self.steps_done) // every * every + every
        return next_at

    def first_checkpoint_at(self) -> int:
        every = self.options.checkpoint_every or 1
        return (self.start_step + self.steps_done) // every * every + every

    def missing_steps(self) -> list[int]:
        """The steps still to run, in order: none recorded yet, or undone by a restore."""
        with self._lock:
            done = {r["step"] for r in self._history}
        return [step for step in range(self.start_step, self.options.steps) if step not in done]

    def lost_ps(self) -> list[str]:
        """The ps tasks that are gone: their engines exited (health), or their servers refuse connections."""
        records = {r.name: r for r in self.cluster.tasks}
        return [name for name in self._ps_names if name not in records or records[name].state in (LOST, RECOVERING)
                or connection.connect_problem(records[name].address, 2.0)]

    def _classify(self, exc: BaseException, where: str) -> BaseException:
        """A remote call's error: ``TaskLost`` if a ps is gone, a ``ClusterStateError`` for a lost worker, else a bug."""
        if not is_infrastructure_error(exc):
            return TrainingError(f"a step on {where} failed: {type(exc).__name__}: {getattr(exc, 'message', exc)}"
                                 f"{native_logs.hint()}")
        lost = self.lost_ps()
        deadline = time.monotonic() + PS_CONFIRM_SECONDS
        while not lost and time.monotonic() < deadline and not self._engine_exited(where):
            # A ps being killed drops its connections a moment before its listening port closes (and
            # before its engine counts as exited): look again before calling it something else.
            time.sleep(0.1)
            lost = self.lost_ps()
        if lost:
            return self._ps_lost(lost)
        return ClusterStateError(f"{where} was lost: {type(exc).__name__}.{native_logs.hint()}")

    def _engine_exited(self, task: str) -> bool:
        """The health monitor saw ``task``'s engine exit: its own loss explains the failed call (no ps to confirm)."""
        records = {r.name: r for r in self.cluster.tasks}
        return task in records and records[task].state == LOST

    def _ps_lost(self, lost: list[str]) -> TaskLost:
        step = self.start_step + self.steps_done
        where = (f"resume from {self.last_checkpoint} with wb.train(..., resume=True) on a new cluster"
                 if self.last_checkpoint else "no checkpoint was written (pass checkpoint_dir= and checkpoint_every=)")
        names = ", ".join(lost)
        error = ParameterServerLost(
            f"the {self._holders} {names} ({', '.join(self._where(n) for n in lost)}) is unreachable, so "
            f"the model's variables are lost at step {step}: {where}.")
        return TaskLost(lost, "was lost (the model's variables lived there)", error)

    def _where(self, name: str) -> str:
        record = self.cluster.task(name)
        return f"{record.task.device} at {record.address}"

    def _recover_state(self, lost: TaskLost) -> None:
        """Re-host the lost tasks, rebuild the job's variables, restore this job's newest checkpoint, go on from it."""
        if self.recoveries >= MAX_RESTORES:
            raise TrainingError(f"{', '.join(lost.tasks)} {lost.why}, after {self.recoveries} restores already in this job: "
                                "giving up (check what kills the task: cluster.status(), the engines' memory).")
        label = lost.label
        source = self.last_checkpoint or "the initial weights (no checkpoint yet: pass checkpoint_every= to redo less)"
        fault = self._supervisor.fault(label, "lost", lost.why, "restored")
        fault.detail += f"; restoring {source}"
        # the dead first: re-hosting a live task updates this kernel's connection, which needs every other task up
        for task in sorted(lost.tasks, key=lambda name: not self._engine_exited(name)):
            self.cluster.replace_task(task, refresh_connection=self._uses_connection)
        kept = self._restore_state()
        self._loop.model_replaced()
        with self._lock:
            fault.redone = len(self._history) - kept
            self._history = self._history[:kept]  # what the restored variables include; the rest runs again
        fault.resumed_from = self.start_step + kept
        self.recoveries += 1
        self._report_progress()
        self._supervisor.settle(label, "restored", f"resumed from step {fault.resumed_from}; {fault.redone} step(s) to run again")

    def _restore_state(self) -> int:
        """Build the job's variables again, on the re-hosted tasks, from its newest checkpoint.

        Returns how many of the history's records (in the order they came) the restored variables include.
        """
        if self.options.seed is not None:
            seed_initializers(self.options.seed)  # without a checkpoint, the same initial weights as at the start
        self._build_variables()
        self._setup_checkpoints(resume=False)
        if self.last_checkpoint:
            self._restore(self.last_checkpoint)
        return self._saved_records.get(self.last_checkpoint, 0)

    def _record(self, step: int, loss: float, metrics, worker: str, start: float, end: float, examples: int,
                last_of_call: bool = False, **extra) -> None:
        """Record one step (``last_of_call``: the newest of its remote call, for the callbacks' batch hooks)."""
        record = self._step_record(step, loss, metrics, worker, start, end, examples, **extra)
        with self._lock:
            self._append(record, last_of_call)
        self._recorder.step_done(record)

    def _append(self, record: dict, last_of_call: bool) -> None:
        """Add ``record`` to the history; the caller holds ``_lock`` (a run may make it one change with its own)."""
        self._history.append(record)
        self._loop.step_done(record, last_of_call)

    def _step_record(self, step: int, loss: float, metrics, worker: str, start: float, end: float, examples: int,
                     **extra) -> dict:
        return {
            "step": step,
            "loss": float(loss),
            **{name: float(v) for name, v in zip(self.metric_names, metrics)},
            "worker": worker,
            "start": float(start),
            "end": float(end),
            "examples": int(examples),
            "examples_per_s": float(examples / max(float(end) - float(start), 1e-9)),
            "recovery": self.recoveries,
            **{key: value.item() if hasattr(value, "item") else value for key, value in extra.items()},  # plain numbers
        }
