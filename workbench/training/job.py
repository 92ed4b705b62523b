"""A training job on a cluster: set-up in the kernel, steps on the workers, variables on the ps tasks.

The kernel schedules; it never carries the data or the per-step parameters. Each worker has a
thread in the kernel bound to it, so the job knows which worker ran each step, gives each worker
its own shard of the data, and can treat the workers differently (backup workers in sync-ps).
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from ..cluster import connection
from ..errors import ClusterStateError, ConfigurationError, WorkbenchError
from ..telemetry.events import APPLY, COMPUTE, PULL, PUSH_APPLY
from ..telemetry.recorder import StepRecorder
from .data import DataContext, evaluation_dataset, training_dataset
from .options import TrainOptions
from .placement import PsPlacer, optimizer_targets, shards_of, tf_variable, variable_device
from .steps import StepFunctions, resolve_loss, resolve_metrics

# Errors that mean "a task went away", as opposed to a bug in the model or data functions.
_INFRASTRUCTURE_ERRORS = ("UnavailableError", "AbortedError", "CancelledError", "DeadlineExceededError", "InternalError")
THREAD_JOIN_SECONDS = 30.0
_JOB_NUMBERS = itertools.count(1)


class TrainingError(WorkbenchError):
    """A training job failed; the message names the task and, where there is one, the checkpoint."""


class ParameterServerLost(TrainingError):
    """A ps task became unreachable: the job cannot go on (its variables lived there)."""


def _reachable(address: str, timeout: float = 2.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def _seed_initializers(seed: int) -> None:
    """What ``keras.utils.set_random_seed`` does, minus ``tf.random.set_seed``.

    Keras draws initializer seeds from Python's ``random``. TensorFlow's global seed is left
    alone: setting it clears the eager caches of every connected task and blocks while any of
    them is stalled. Data pipelines get their seed explicitly (``ctx.seed``).
    """
    import random

    import numpy as np
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator
    from keras.src.utils import rng_utils

    global_state.set_global_attribute(rng_utils.GLOBAL_RANDOM_SEED, seed)
    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, None)
    random.seed(seed)
    np.random.seed(seed)


def _build_model(model: Any, example_features) -> Any:
    import keras
    import tensorflow as tf

    if isinstance(model, keras.Model):
        try:
            built = keras.models.clone_model(model)
        except Exception as exc:  # noqa: BLE001 - subclassed models cannot be cloned; say what to pass instead
            raise ConfigurationError(
                f"cannot re-create {type(model).__name__} with its variables on the ps tasks ({exc}): pass a "
                "function that builds the model instead, e.g. model=make_model."
            ) from None
    elif callable(model):
        built = model()
        if not isinstance(built, keras.Model):
            raise ConfigurationError(f"the model function returned {type(built).__name__}, not a keras.Model.")
    else:
        raise ConfigurationError(f"model={model!r}: pass a function that builds a keras.Model (or a keras.Model).")
    if not built.built or not built.weights:
        built(tf.zeros([1, *example_features.shape[1:]], example_features.dtype))
    return built


def _build_optimizer(optimizer: Any) -> Any:
    import keras

    if isinstance(optimizer, keras.optimizers.Optimizer):
        # Re-create it here so that its variables (iterations, slots) live on the ps tasks too.
        return type(optimizer).from_config(optimizer.get_config())
    if isinstance(optimizer, (str, dict)):  # a name, or a config {"class_name": ..., "config": {...}}
        try:
            return keras.optimizers.get(optimizer)
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(f"optimizer={optimizer!r} is not a Keras optimizer: {exc}") from None
    if callable(optimizer):
        return _build_optimizer(optimizer())
    raise ConfigurationError(f"optimizer={optimizer!r}: pass a name ('adam'), a keras optimizer, or a function returning one.")


def _update_where_the_variable_lives(optimizer) -> None:
    """Run the optimizer's per-variable update math on the variable's own device.

    Keras places an update under the caller's device, so an update issued from a worker would read
    the optimizer slots (e.g. Adam's m and v) from the ps, compute there and write them back: about
    four times the bytes of a gradient push. Colocated, a step moves the parameters and the gradient.
    """
    import tensorflow as tf

    update_step = optimizer.update_step

    def colocated(gradient, variable, learning_rate):
        with tf.device(variable_device(variable)):
            return update_step(gradient, variable, learning_rate)

    optimizer.update_step = colocated


_DEFAULT_EXECUTOR: list = []  # the raw handle of TF's default executor (no Python wrapper: see below)
_DEFAULT_EXECUTOR_LOCK = threading.Lock()


def _own_executor(work: Callable) -> Callable:
    """Run a worker's thread on its own TF executor.

    Threads of one process share TensorFlow's default executor, which runs their remote calls one
    after the other: a worker that is slow to produce its batch then holds up every other
    worker's calls (measured: the fast workers' parameter pulls took 93 ms instead of 7 behind a
    straggler's 110 ms step). ClusterCoordinator does the same for the same reason.

    Not ``context.executor_scope``: leaving it drops a wrapper of the default executor, whose
    ``__del__`` waits for *every* thread's pending work, and so hangs behind a stalled task. So
    the thread switches with the raw handles that ``context.executor`` itself uses.
    """
    import functools

    @functools.wraps(work)
    def run(*args, **kwargs):
        from tensorflow.python import pywrap_tfe
        from tensorflow.python.eager import context, executor

        ctx = context.context()
        ctx.ensure_initialized()
        with _DEFAULT_EXECUTOR_LOCK:
            if not _DEFAULT_EXECUTOR:  # a new thread starts on the default executor
                _DEFAULT_EXECUTOR.append(pywrap_tfe.TFE_ContextGetExecutorForThread(ctx._context_handle))
        own = executor.new_executor(enable_async=False, enable_streaming_enqueue=False)
        ctx.executor = own
        try:
            return work(*args, **kwargs)
        finally:
            pywrap_tfe.TFE_ContextSetExecutorForThread(ctx._context_handle, _DEFAULT_EXECUTOR[0])
            try:  # a lost task leaves its error on the executor; clear it here, not in a noisy __del__
                own.wait()
            except Exception:  # noqa: BLE001 - already classified by the work function
                own.clear_error()

    return run


class Job:
    """A running or finished training job. Returned by ``wb.train``.

    ``wait()`` blocks until it ends; ``history`` holds one record per step; ``evaluate(data)``
    runs on the trained variables; ``model`` is a local Keras model with the trained weights.
    """

    def __init__(self, cluster, model: Any, data: Callable, loss: Any, optimizer: Any, options: TrainOptions):
        self.cluster = cluster
        self.options = options
        self._data = data
        self._model_source = model
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._history: list[dict] = []
        self.state = "starting"
        self.error: BaseException | None = None
        self.dropped_gradients = 0
        self.lost_workers: list[str] = []
        self.last_checkpoint: str | None = None
        self.start_step = 0
        self.placer: PsPlacer | None = None  # ps strategies: where each variable went
        self._workers = [r for r in cluster.tasks if r.job == "worker"]
        self.metric_names = list(resolve_metrics(options.metrics))
        self.name = f"{options.strategy}-{next(_JOB_NUMBERS)}"
        self._setup(cluster, model, data, loss, optimizer, options)
        self._recorder = StepRecorder(cluster.telemetry if options.telemetry else None, self.name,
                                      cluster.clock_offsets() if options.telemetry else None)
        self._started = time.time()
        self._thread = threading.Thread(target=self._drive, name="workbench-job", daemon=True)

    def _setup(self, cluster, model: Any, data: Callable, loss: Any, optimizer: Any, options: TrainOptions) -> None:
        """Parameter-server strategies: variables on the ps tasks, steps driven from this kernel."""
        import tensorflow as tf

        self._epoch = connection.connect(cluster)
        ps_tasks = [r for r in cluster.tasks if r.job == "ps"]
        if not ps_tasks:
            raise ConfigurationError(
                f"strategy={options.strategy!r} keeps the variables on ps tasks, and cluster {cluster.name!r} has none: "
                "start it with ps=1 or more."
            )
        self._ps_devices = [f"{r.task.device}/device:CPU:0" for r in ps_tasks]
        self._ps_names = [r.name for r in ps_tasks]
        self._ps_addresses = [r.address for r in ps_tasks]
        self._worker_devices = [f"{r.task.device}/device:CPU:0" for r in self._workers]
        seed = self._probe_data(data, options)
        self.placer = PsPlacer(self._ps_devices, options.partition_bytes)
        with tf.variable_creator_scope(self.placer):
            self._model = _build_model(model, tf.zeros(self._example_shape, self._example_dtype))
            targets, splits = optimizer_targets(self._model.trainable_variables)
            self._optimizer = _build_optimizer(optimizer)
            _update_where_the_variable_lives(self._optimizer)
            self._optimizer.build(targets)
            with tf.device(self._ps_devices[0]):
                self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="workbench_step")
        self._fns = StepFunctions(self._model, self._optimizer, resolve_loss(loss), resolve_metrics(options.metrics), targets, splits)
        self._setup_checkpoints()
        self._iterators = self._make_iterators(seed)

    def _probe_data(self, data: Callable, options: TrainOptions) -> int:
        """Seed Keras, learn the example shape from the data function; return the data seed."""
        seed = 0 if options.seed is None else options.seed
        if options.seed is not None:
            _seed_initializers(options.seed)
        probe = data(DataContext(0, options.num_workers, options.per_worker_batch, seed))
        example = training_dataset(lambda _ctx: probe, DataContext(0, 1, 1, seed)).element_spec[0]
        self._example_shape, self._example_dtype = [1, *example.shape[1:]], example.dtype
        return seed

    def _setup_checkpoints(self) -> None:
        import tensorflow as tf

        options = self.options
        self._checkpoint = None
        if options.checkpoint_dir:
            if self.placer is not None and self.placer.partitioned:
                # a Keras model cannot checkpoint a partitioned variable itself: save the shards
                weights = [shard for w in self._model.weights for shard in shards_of(w)]
                self._checkpoint = tf.train.Checkpoint(weights=weights, optimizer=self._optimizer, step=self._step)
            else:
                self._checkpoint = tf.train.Checkpoint(model=self._model, optimizer=self._optimizer, step=self._step)
            self._manager = tf.train.CheckpointManager(self._checkpoint, options.checkpoint_dir, max_to_keep=3)
            if options.resume:
                self._checkpoint.restore(self._manager.latest_checkpoint).expect_partial()
                self.start_step = int(self._step.numpy())
                self.last_checkpoint = self._manager.latest_checkpoint

    def _make_iterators(self, seed: int) -> list:
        import tensorflow as tf

        iterators = []
        n = len(self._worker_devices)
        for index, device in enumerate(self._worker_devices):
            ctx = DataContext(index, n, self.options.per_worker_batch, seed)
            make = tf.function(lambda ctx=ctx: training_dataset(self._data, ctx), autograph=False).get_concrete_function()
            with tf.device(device):  # the pipeline is built and runs on that worker
                iterators.append(iter(make()))
        return iterators

    # -- public ------------------------------------------------------------------------------

    def start(self) -> Job:
        self.state = "running"
        self._report_progress()
        self._thread.start()
        return self

    def _report_progress(self) -> None:
        self._recorder.progress(self.steps_done, self.options.steps - self.start_step, self.state, self._started,
                                self.options.strategy, [r.name for r in self._workers])

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
        }

    @property
    def history(self) -> list[dict]:
        """One record per step: step, loss, metrics, worker(s), worker-side start/end time, examples/s."""
        with self._lock:
            return sorted((dict(r) for r in self._history), key=lambda r: r["step"])

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
        """Block until the job ends; raise its error if it failed."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the job is still running after {timeout} s ({self.steps_done} steps done); wait longer or job.stop().")
        if self.error is not None:
            raise self.error
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Ask the job to stop after the steps in flight; wait for that."""
        self._stop.set()
        self._thread.join(timeout)

    def evaluate(self, data: Callable | None = None, batch_size: int = 256) -> dict[str, float]:
        """Loss and metrics of the trained variables over one pass of ``data(ctx)`` (on ``worker:0``)."""
        import tensorflow as tf

        connection.check_epoch(self._epoch, "this job")
        data = data or self._data
        seed = 0 if self.options.seed is None else self.options.seed
        self._fns.build_evaluate(tf.autograph.experimental.do_not_convert(lambda: evaluation_dataset(data, batch_size, seed)))
        with tf.device(self._worker_devices[0]):
            values, count = self._fns.evaluate()
        values = values.numpy().tolist()
        return {"loss": values[0], **dict(zip(self.metric_names, values[1:])), "examples": int(count.numpy())}

    @property
    def model(self):
        """A local Keras model (in this kernel, no cluster needed) holding the trained weights."""
        import tensorflow as tf

        connection.check_epoch(self._epoch, "this job")
        with tf.device("/job:localhost/replica:0/task:0/device:CPU:0"):
            local = _build_model(self._model_source, tf.zeros(self._example_shape, self._example_dtype))
        local.set_weights([tf.convert_to_tensor(tf_variable(w)).numpy() for w in self._model.weights])
        return local

    def __repr__(self) -> str:
        return f"<workbench.Job {self.options.strategy} {self.state}: {self.steps_done}/{self.options.steps - self.start_step} steps>"

    # -- the driver --------------------------------------------------------------------------

    def _async_step_options(self) -> dict:
        return {}

    def _run(self) -> None:
        if self.options.strategy == "async-ps":
            self._run_async()
        else:
            self._run_sync()

    def _drive(self) -> None:
        try:
            self._run()
            if self.options.checkpoint_dir:
                self._save()
            self.state = "cancelled" if self._stop.is_set() else "done"
        except BaseException as exc:  # noqa: BLE001 - kept for wait() to raise in the caller's thread
            if isinstance(exc, WorkbenchError):
                self.error = exc
            elif isinstance(exc, Exception):  # e.g. a checkpoint save that found the ps gone
                self.error = self._classify(exc, "the job's driver (checkpointing)")
            else:
                self.error = TrainingError(f"training failed: {type(exc).__name__}: {exc}")
            self.state = "failed"
        self._report_progress()
        self._trim_engines()

    def _trim_engines(self) -> None:
        """Return what the job's engines freed to the system (a memory-capped container counts it); no waiting."""
        from ..cluster.memory import trim_memory

        try:
            alive = set(self.cluster.client.ids)
            engines = [r.engine_id for r in self.cluster.tasks if r.engine_id in alive]
            if engines:
                self.cluster.client[engines].apply_async(trim_memory)
        except Exception:  # noqa: BLE001 - an optimisation: a stopped cluster or a lost engine needs none
            pass

    def _save(self) -> None:
        self._step.assign(self.start_step + self.steps_done)
        self.last_checkpoint = self._manager.save(checkpoint_number=self.start_step + self.steps_done)

    def _classify(self, exc: BaseException, worker: str) -> BaseException:
        """A lost ps fails the job (naming the checkpoint); a lost worker does not; other errors are bugs."""
        if type(exc).__name__ not in _INFRASTRUCTURE_ERRORS:
            return TrainingError(f"a step on {worker} failed: {type(exc).__name__}: {getattr(exc, 'message', exc)}")
        for address, device in zip(self._ps_addresses, self._ps_devices):
            if not _reachable(address):
                where = (f"resume from {self.last_checkpoint} with wb.train(..., resume=True) on a new cluster"
                         if self.last_checkpoint else "no checkpoint was written (pass checkpoint_dir= and checkpoint_every=)")
                return ParameterServerLost(
                    f"the parameter server {device.split('/device')[0]} ({address}) is unreachable, so the model's "
                    f"variables are lost at step {self.start_step + self.steps_done}: {where}."
                )
        return ClusterStateError(f"{worker} was lost: {type(exc).__name__}")

    def _record(self, step: int, loss: float, metrics, worker: str, start: float, end: float, examples: int, **extra) -> None:
        record = {
            "step": step,
            "loss": float(loss),
            **{name: float(v) for name, v in zip(self.metric_names, metrics)},
            "worker": worker,
            "start": float(start),
            "end": float(end),
            "examples": examples,
            "examples_per_s": examples / max(end - start, 1e-9),
            **extra,
        }
        with self._lock:
            self._history.append(record)
        self._recorder.step_done(record)

    def _checkpoint_due(self, next_at: int) -> int:
        if self.options.checkpoint_dir and self.options.checkpoint_every and self.steps_done >= next_at:
            self._save()
            return next_at + self.options.checkpoint_every
        return next_at

    # async-ps: every worker runs chunks of steps, each applying its own updates ----------------

    def _run_async(self) -> None:
        import tensorflow as tf

        self._fns.build_async(**self._async_step_options())
        total = self.options.steps - self.start_step
        chunk = self.options.steps_per_call
        pending = [(self.start_step + i, min(chunk, total - i)) for i in range(0, total, chunk)]
        pending.reverse()
        failures: list[BaseException] = []
        lost: list[str] = []
        checkpoint_lock = threading.Lock()
        next_checkpoint = [self.options.checkpoint_every]

        def after_chunk() -> None:  # right away, in the worker's thread: checkpoints land close to each multiple
            with checkpoint_lock:
                next_checkpoint[0] = self._checkpoint_due(next_checkpoint[0])

        def claim():
            with self._lock:
                return pending.pop() if pending and not self._stop.is_set() and not failures else None

        in_flight: dict[int, tuple] = {}  # worker index -> (chunk, monotonic start, telemetry key)
        gone: set[int] = set()  # workers lost (dead) or given up on (stalled)

        @_own_executor
        def work(index: int) -> None:
            name, device, iterator = self._workers[index].name, self._worker_devices[index], self._iterators[index]
            while (item := claim()) is not None:
                first, n = item
                key = self._recorder.call_started(name, device, first, n)
                with self._lock:
                    in_flight[index] = (item, time.monotonic(), key)
                try:
                    with tf.device(device):
                        losses, metrics, stamps, marks = self._fns.train_steps(iterator, tf.constant(n, tf.int32))
                    losses, metrics, stamps, marks = losses.numpy(), metrics.numpy(), stamps.numpy(), marks.numpy()
                except Exception as exc:  # noqa: BLE001 - classified below
                    self._recorder.call_ended(key)
                    with self._lock:
                        if in_flight.pop(index, None) is None:
                            return  # given up on already; its chunk was re-queued then
                        pending.append(item)  # its steps are re-run on another worker
                        gone.add(index)
                    error = self._classify(exc, name)
                    if isinstance(error, ClusterStateError):
                        lost.append(name)
                    else:
                        failures.append(error)
                    return
                with self._lock:
                    if in_flight.pop(index, None) is None:
                        return  # it came back after being given up on: its steps ran elsewhere
                self._recorder.steps(name, device, first, stamps, marks, self.options.per_worker_batch, PUSH_APPLY, key)
                for i in range(n):
                    self._record(first + i, losses[i], metrics[i], name, stamps[i], stamps[i + 1], self.options.per_worker_batch)
                try:
                    after_chunk()
                except Exception as exc:  # noqa: BLE001 - a checkpoint that found the ps gone
                    failures.append(self._classify(exc, "the job's checkpointing"))
                    return

        def launch(index: int) -> threading.Thread:
            thread = threading.Thread(target=work, args=(index,), daemon=True, name=f"workbench-{self._workers[index].name}")
            thread.start()
            return thread

        threads = {i: launch(i) for i in range(len(self._workers))}
        while any(t.is_alive() for i, t in threads.items() if i not in gone):
            time.sleep(0.05)
            with self._lock:
                # A call that neither returns nor fails (a stalled task) is given up on after step_timeout:
                # TensorFlow cannot cancel it, so its chunk is re-queued and its late result dropped.
                for index, (item, started, key) in list(in_flight.items()):
                    if time.monotonic() - started > self.options.step_timeout:
                        del in_flight[index]
                        self._recorder.call_ended(key)
                        gone.add(index)
                        pending.append(item)
                        lost.append(self._workers[index].name)
                idle = [i for i, t in threads.items() if not t.is_alive() and i not in gone]
            if pending and not failures:
                for index in idle:  # workers that finished early take the re-queued chunks
                    threads[index] = launch(index)
        if failures:
            raise failures[0]
        if pending and not self._stop.is_set():
            raise TrainingError(f"every worker was lost ({', '.join(lost)}); {self.steps_done} of {total} steps ran.")
        self.lost_workers = lost

    # sync-ps: each step aggregates the first N - k gradients, drops the late ones ------------------

    def _run_sync(self) -> None:
        import tensorflow as tf

        replicas, buffers = [], []
        for device in self._worker_devices:  # each worker computes on its own replica and keeps its gradient
            with tf.device(device):
                replicas.append(_build_model(self._model_source, tf.zeros(self._example_shape, self._example_dtype)))
                buffers.append([tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False, name=f"grad_{i}")
                                for i, v in enumerate(self._model.trainable_variables)])
        self._fns.build_sync(replicas, buffers)

        current = {"step": -1}
        halt = threading.Event()  # set when the driver is done or the user stopped the job
        cond = threading.Condition()
        results: dict[int, list] = defaultdict(list)  # step -> arrivals, in the order the kernel saw them
        failures: list[BaseException] = []
        alive = set(range(len(self._workers)))
        required = self.options.required_gradients

        @_own_executor
        def work(index: int) -> None:
            name, device, iterator = self._workers[index].name, self._worker_devices[index], self._iterators[index]
            pull, compute = self._fns.pull[index], self._fns.compute_gradient[index]
            last = -1
            while True:
                with cond:
                    while current["step"] <= last and not halt.is_set() and not self._stop.is_set() and not failures:
                        cond.wait(0.5)
                    if halt.is_set() or self._stop.is_set() or failures:
                        return
                    step = current["step"]
                key = self._recorder.call_started(name, device, step, 1)
                try:
                    with tf.device(device):
                        pulled = pull().numpy()  # the replica holds this step's parameters before computing on it
                        loss, metrics, stamps = compute(iterator)
                    loss, metrics, stamps = float(loss.numpy()), metrics.numpy(), stamps.numpy()
                except Exception as exc:  # noqa: BLE001 - classified below
                    self._recorder.call_ended(key)
                    error = self._classify(exc, name)
                    with cond:
                        alive.discard(index)
                        if not isinstance(error, ClusterStateError):
                            failures.append(error)
                        elif len(alive) < required:
                            failures.append(TrainingError(
                                f"{name} was lost and only {len(alive)} worker(s) remain for the {required} gradient(s) "
                                "each sync-ps step needs: scale the cluster back up, or use more backup_workers."))
                        cond.notify_all()
                    return
                self._recorder.span(name, device, PULL, step, pulled[0], pulled[1])
                self._recorder.span(name, device, COMPUTE, step, stamps[0], stamps[1], self.options.per_worker_batch, key)
                with cond:
                    results[step].append((index, name, loss, metrics, stamps))
                    cond.notify_all()
                last = step

        threads = [threading.Thread(target=work, args=(i,), daemon=True, name=f"workbench-{w.name}") for i, w in enumerate(self._workers)]
        for thread in threads:
            thread.start()
        next_checkpoint = self.options.checkpoint_every
        try:
            for step in range(self.start_step, self.options.steps):
                if self._stop.is_set():
                    break
                with cond:
                    current["step"] = step
                    cond.notify_all()
                    deadline = time.monotonic() + self.options.step_timeout
                    while len(results[step]) < required and not failures and time.monotonic() < deadline:
                        cond.wait(0.5)
                    if failures:
                        raise failures[0]
                    if len(results[step]) < required:
                        raise TrainingError(
                            f"sync-ps step {step} waited {self.options.step_timeout:.0f} s for {required} gradient(s) and got "
                            f"{len(results[step])}: check the workers (cluster.status()), add backup_workers, or raise step_timeout.")
                    arrived = results[step][:required]  # the first N - k; later ones are dropped
                try:
                    with tf.device(self._ps_devices[0]):  # wait until every update landed: the next pulls read them
                        applied = self._fns.apply_gradients(tuple(sorted(a[0] for a in arrived))).numpy()
                except Exception as exc:  # noqa: BLE001 - classified
                    raise self._classify(exc, "the ps tasks") from None
                self._recorder.span(self._ps_names[0], self._ps_devices[0], APPLY, step, applied[0], applied[1],
                                    required * self.options.per_worker_batch)
                loss = sum(a[2] for a in arrived) / required
                metrics = [sum(a[3][i] for a in arrived) / required for i in range(len(self.metric_names))]
                self._record(step, loss, metrics, ",".join(a[1] for a in arrived), min(a[4][0] for a in arrived),
                             max(a[4][1] for a in arrived), required * self.options.per_worker_batch, aggregated=required)
                next_checkpoint = self._checkpoint_due(next_checkpoint)
        finally:
            halt.set()
            with cond:
                cond.notify_all()
            for thread in threads:
                thread.join(THREAD_JOIN_SECONDS)
        with cond:
            computed = sum(len(v) for v in results.values())
        self.dropped_gradients = computed - sum(r.get("aggregated", 0) for r in self._history)
