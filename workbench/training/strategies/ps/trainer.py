"""The trainer of the parameter-server strategies (async-ps, sync-ps): variables on the ps tasks, steps from the kernel.

``PsTrainer`` builds the model, optimizer and step counter with their variables placed on the ps tasks
(``placement.PsPlacer``), one input pipeline per worker, the step functions, and the checkpoints; the
loops that run the steps are ``async_ps.AsyncRun`` and ``sync_ps.SyncRun``. A placed model's trainer
(``strategies/placed.py``: ``PlacedTrainer``) is one too, with the layers' tasks in the part of the ps tasks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ....cluster.process import connection
from ....errors import ClusterStateError, ConfigurationError
from ...data import DataContext, batch_spec, evaluation_dataset, features_of, training_dataset
from ...fit.evaluation import is_dataset, named_results
from ...job.trainer import HeldByJob
from ...job.workers import CallGate, compute_device, input_device, trim_engines
from ...modelling.building import (
    build_model,
    build_optimizer,
    compile_like_the_job,
    local_model,
    seed_initializers,
    update_where_the_variable_lives,
)
from ...modelling.losses import resolve_metrics
from ...modelling.placement import PsPlacer, optimizer_targets, shards_of, tf_variable
from ...modelling.steps import StepFunctions
from ...options import validate
from ..async_ps import AsyncRun
from ..sync_ps.run import SyncRun
from .packing import packing_for
from .validation import validate_on_workers


class PsTrainer(HeldByJob):
    """The ``Trainer`` of ``wb.AsyncPS`` and ``wb.SyncPS``: variables on the ps tasks, steps driven from this kernel.

    What its runs (``AsyncRun``, ``SyncRun``) and validation use is public here: ``fns`` (the step functions),
    ``iterators`` (each worker's input pipeline), ``optimizer``, ``worker_devices``, ``ps_devices``, ``restore_tasks`` (the ps
    tasks' names) and ``seed``.
    """

    holders = "parameter server"
    uses_connection = True

    def __init__(self, job):
        super().__init__(job)
        self.restore_tasks: list[str] = []
        self.ps_devices: list[str] = []
        self.worker_devices: list[str] = []
        self.fns: StepFunctions | None = None
        self.iterators: list = []
        self.seed = 0
        self.placer: PsPlacer | None = None  # where each variable went
        self.epoch: int | None = None  # the kernel's connection it was built under
        self._model = self.optimizer = self._step = self._checkpoint = self._manager = None  # built by set_up
        self._local_weights: list | None = None  # the trained weights, kept when the kernel's connection is replaced
        self.gate = CallGate()  # calls that wait on each other (sync-ps's), across the job's runs, make way for updates
        self._pipelines = threading.Lock()  # a re-hosting's new input pipeline, against the job's end letting them go

    @property
    def model_source(self):
        """What the model is built from (``make_model``, or a model to clone)."""
        return self.job.inputs.model

    def set_up(self) -> None:
        job = self.job
        self.epoch = connection.connect(job.cluster, holder=job)
        ps_tasks = [r for r in job.cluster.tasks if r.job == "ps"]
        if not ps_tasks:
            raise ConfigurationError(
                f"strategy={self.options.strategy.name!r} keeps the variables on ps tasks, and cluster {job.cluster.name!r} "
                "has none: start it with ps=1 or more."
            )
        self.ps_devices = [f"{r.task.device}/device:CPU:0" for r in ps_tasks]
        self.restore_tasks = [r.name for r in ps_tasks]
        self.worker_devices = [compute_device(r) for r in job.workers]  # a worker's GPU where it has one
        self.seed = self._probe_data()
        self._build_variables()
        self._setup_checkpoints(resume=self.options.resume)
        self.iterators = self._make_iterators()

    def _build_variables(self) -> None:
        """The model, the optimizer and the step counter, with their variables on the ps tasks; the step functions."""
        import tensorflow as tf

        self.placer = PsPlacer(self.ps_devices, self.options.strategy.partition_bytes)
        with tf.variable_creator_scope(self.placer):
            self._model = build_model(self.model_source, tf.zeros(self._example_shape, self._example_dtype))
            targets, splits = optimizer_targets(self._model.trainable_variables)
            self.optimizer = build_optimizer(self.job.inputs.optimizer)
            update_where_the_variable_lives(self.optimizer)
            self.optimizer.build(targets)
            with tf.device(self.ps_devices[0]):
                self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="workbench_step")
        self.fns = StepFunctions(self._model, self.optimizer, self.job.loss_fn, resolve_metrics(self.options.metrics),
                                 targets, splits, packing_for(self._model, targets, self.options.strategy.transfer),
                                 job_name=self.job.name)  # the same job after a ps's restore
        if self.options.strategy.transfer != "fp32" and self.fns.packing is None:
            raise ConfigurationError(
                f"transfer={self.options.strategy.transfer!r} needs a model whose trainable variables are all Keras "
                "variables (it runs on the received values through keras.StatelessScope); this one has others. "
                "Build it from Keras layers, or leave transfer='fp32'.")

    def _probe_data(self) -> int:
        """Seed Keras, learn the example shape from the data function; return the data seed."""
        options = self.options
        seed = 0 if options.seed is None else options.seed
        if options.seed is not None:
            seed_initializers(options.seed)
        probe = self.job.inputs.data(DataContext(0, options.num_workers, options.per_worker_batch, seed))
        self._batch_spec = batch_spec(lambda _ctx: probe, DataContext(0, 1, 1, seed))
        self._example_shape, self._example_dtype = features_of(self._batch_spec)
        return seed

    def _setup_checkpoints(self, resume: bool) -> None:
        import tensorflow as tf

        self._checkpoint = None
        if self.options.checkpoint:
            if self.placer is not None and self.placer.partitioned:
                # a Keras model cannot checkpoint a partitioned variable itself: save the shards
                weights = [shard for w in self._model.weights for shard in shards_of(w)]
                self._checkpoint = tf.train.Checkpoint(weights=weights, optimizer=self.optimizer, step=self._step)
            else:
                self._checkpoint = tf.train.Checkpoint(model=self._model, optimizer=self.optimizer, step=self._step)
            with tf.device(self.ps_devices[0]):
                self._checkpoint.save_counter  # noqa: B018 - made now, on the ps (see save)
            self._manager = tf.train.CheckpointManager(self._checkpoint, self.options.checkpoint.directory,
                                                     max_to_keep=self.options.checkpoint.keep)
            if resume:
                self._checkpoint.restore(self._manager.latest_checkpoint).expect_partial()
                self.job.last_checkpoint = self._manager.latest_checkpoint
                self.job.start_step = int(self._step.numpy())

    def _make_iterators(self) -> list:
        """Every worker's input pipeline, made (again) on its worker."""
        return [self._make_iterator(i) for i in range(len(self.worker_devices))]

    def _make_iterator(self, index: int):
        """The input pipeline of worker ``index``, built and run on that worker."""
        import tensorflow as tf

        ctx = DataContext(index, len(self.worker_devices), self.options.per_worker_batch, self.seed)
        data = self.job.inputs.data
        make = tf.function(lambda: training_dataset(data, ctx), autograph=False).get_concrete_function()
        with tf.device(input_device(self.job.workers[index])):
            return iter(make())

    def rebuild_worker(self, index: int) -> None:
        """Worker ``index`` was re-hosted: this kernel's connection reaches its new server (``connection.refresh``)
        and what the job kept on it (its input pipeline) is made again there, between the calls made through ``gate``."""
        cluster = self.job.cluster
        with self.gate.quiet(self.options.recovery.step_timeout), self._pipelines:
            if index >= len(self.iterators):  # the job ended meanwhile (release): the next job's connect() reaches it
                return
            connection.refresh(cluster, self.job.workers[index].name, cluster.start_timeout)
            self.iterators[index] = self._make_iterator(index)
        if self.fns is not None:
            self.fns.forget_worker(self.worker_devices[index])

    def evaluate(self, data: Callable, batch_size: int) -> dict[str, float]:
        """One pass of ``data(ctx)`` on ``worker:0``, on the trained variables where they live."""
        import tensorflow as tf

        connection.check_epoch(self.epoch, "this job")
        seed = 0 if self.options.seed is None else self.options.seed
        evaluate = self.fns.evaluation_function(
            tf.autograph.experimental.do_not_convert(lambda: evaluation_dataset(data, batch_size, seed)))
        with tf.device(self.worker_devices[0]):
            values, count = evaluate()
        return named_results(values.numpy().tolist(), self.job.metric_names, count.numpy())

    def example_rank(self) -> int:
        return len(self._example_shape)

    def callback_model(self):
        """The callbacks' model: the job's own, whose variables live on the tasks, compiled like the job (on the
        first ps: its loss tracker's variables too), so that what a callback reads or sets is read or set there."""
        import tensorflow as tf

        model = self._model
        if not getattr(model, "compiled", False):
            with tf.device(self.ps_devices[0]):
                compile_like_the_job(model, self.optimizer, self.job.inputs.loss, self.options.metrics, self._batch_spec)
        return model, None

    def validate(self, data: Any, steps: int | None) -> dict[str, float]:
        """Validation at an epoch's end, on the trained variables where they live: a data function on every
        worker at once (each its share of the batches), a dataset in this kernel."""
        if is_dataset(data):
            return self.job.validate_dataset(self._model, data, steps)
        return validate_on_workers(self.job, self, data, steps)

    def model_on_tasks(self):
        return self._model

    def local_model(self):
        """A local Keras model (in this kernel, no cluster needed) holding the trained weights."""
        weights = self._local_weights
        if weights is None:
            connection.check_epoch(self.epoch, "this job")
            weights = self._read_weights()
        return local_model(self.model_source, self._example_shape, self._example_dtype, weights)

    def _read_weights(self) -> list:
        import tensorflow as tf

        return [tf.convert_to_tensor(tf_variable(w)).numpy() for w in self._model.weights]

    def _keep_weights(self) -> None:
        """Read the trained weights into this kernel once (``job.model`` then needs no task)."""
        if self._local_weights is None and self._model is not None:
            try:
                self._local_weights = self._read_weights()
            except Exception:  # noqa: BLE001 - the tasks are gone (a stopped cluster): job.model then says so
                pass

    def release(self) -> None:
        """The job ended: keep its trained weights here (``job.model`` needs no task from now on) and the variables
        where they live (``job.evaluate``); let go of the step functions, input pipelines and checkpoint writer."""
        if self.job.error is None:
            self._keep_weights()
        with self._pipelines:  # a re-hosting making a worker's pipeline finishes first, or finds none to replace
            self.iterators = []
        self._checkpoint, self._manager = None, None
        if self.fns is not None:
            self.fns.release_steps()

    def release_remote(self) -> None:
        """The kernel connects elsewhere: keep the trained weights here (``job.model``), drop what lived on the tasks."""
        self._keep_weights()
        self._model = self.optimizer = self._step = self.fns = self._checkpoint = self._manager = None
        self.iterators = []

    def free_engines(self) -> None:
        trim_engines(self.job.cluster)

    def bytes_per_step(self) -> dict | None:
        """What one step of one worker moves between it and the ps tasks: parameters in, gradients out."""
        packing = getattr(self.fns, "packing", None)
        if packing is None:
            return None
        each = packing.bytes_per_transfer()
        return {"parameters": each, "gradients": each, "total": 2 * each}

    def info(self) -> dict:
        return {"ps_bytes": dict(self.placer.loads) if self.placer else {},
                "partitioned": dict(self.placer.partitioned) if self.placer else {},
                "reused_step_function": bool(getattr(self.fns, "reused", False))}

    def async_step_options(self) -> dict:
        """What ``StepFunctions.build_async`` takes besides its defaults (a placed model: its output device)."""
        return {"overlap": self.options.strategy.overlap}

    def run(self) -> None:
        (SyncRun if self.options.strategy.synchronous else AsyncRun)(self.job, self).run()

    def save(self, step: int) -> str:
        import tensorflow as tf

        self._step.assign(step)
        with tf.device(self.ps_devices[0]):
            # TensorFlow saves a checkpoint that spans two tasks with a new tf.function each time, and
            # registers it on every task, holding the GIL: a stopped worker froze the whole kernel. Its
            # bookkeeping ("/cpu:0": the save counter, the object graph) goes on the first ps here, so
            # that with one ps a save is plain ops on that ps; with more, no save starts while a task
            # is silent (checkpoint_due).
            return self._manager.save(checkpoint_number=step)

    def restore(self, checkpoint: str | None, step: int) -> None:
        """Build the job's variables again, on the re-hosted tasks, from ``checkpoint`` (None: the initial weights).

        Every worker's input pipeline is made again too: the loss cancelled the calls in flight, and an iterator
        whose ``IteratorGetNext`` was cancelled can answer "End of sequence" ever after, although it repeats
        forever (seen once in the suite: async-ps, a killed ps, worker:1's first call after the restore).
        """
        if self.options.seed is not None:
            seed_initializers(self.options.seed)  # without a checkpoint, the same initial weights as at the start
        self._build_variables()
        self.iterators = self._make_iterators()
        self._setup_checkpoints(resume=False)
        if checkpoint:
            self._checkpoint.restore(checkpoint).expect_partial()

    # -- the cluster scaled while the job trains ---------------------------------------------------

    def check_rescale(self, workers: int) -> None:
        try:
            self.options.strategy.check_workers(workers, self.options.batch_size)
        except ConfigurationError as exc:
            raise ConfigurationError(f"{self.job.describe()} cannot follow a scale to {workers} worker(s): {exc}") from None

    def _resize_connection(self, leaving: tuple[str, ...], joining: list[str]) -> None:
        """This kernel's connection takes the cluster's workers, less ``leaving``, before the job places anything on them.

        It cannot while a task does not answer: a worker being re-hosted (its re-hosting brings the connection to the
        cluster's tasks, new workers included), or one just lost. Workers ``joining`` are waited for, up to
        ``step_timeout``; workers that only leave need no wait (they leave the connection with the next update).
        """
        cluster, timeout = self.job.cluster, self.options.recovery.step_timeout
        deadline = time.monotonic() + timeout
        while not connection.resize(cluster, leaving, timeout=max(1.0, deadline - time.monotonic())) and joining:
            if self.job.stop_requested:  # job.stop(): the wait ends with the job, cancelled
                raise ClusterStateError(f"{self.job.describe()} was stopped while it waited for {', '.join(joining)}.")
            if time.monotonic() >= deadline:
                silent = [r.name for r in cluster.tasks if connection.connect_problem(r.address, 1.0)]
                raise ClusterStateError(
                    f"{self.job.describe()} could not take {', '.join(joining)} within {timeout:.0f} s: this kernel's "
                    f"connection cannot reach new workers while {', '.join(silent) or 'a task'} does not answer. Check "
                    "cluster.status(), then train again.")
            time.sleep(0.1)

    def follow_scale(self, leaving: set[str]) -> bool:
        """At a step boundary (no call in flight): the job's workers become the cluster's, less those leaving.

        The kernel's connection grows or shrinks in place, each worker gets its input pipeline again (its new
        index and count), the options follow (``elastic_batch``). False when nothing changed (followed already:
        the job set up after the scale).
        """
        job = self.job
        workers = [r for r in job.cluster.tasks if r.job == "worker" and r.name not in leaving]
        if [r.name for r in workers] == [r.name for r in job.workers]:
            return False
        # what the job holds on the workers that leave goes first, while this kernel's connection still has them:
        # let go of after the resize, an input pipeline's deletion targets a task the connection no longer knows
        # ("Client for target /job:worker/replica:0/task:2 not found", raised at the job's next op)
        devices = [compute_device(r) for r in workers]
        staying = {r.name for r in workers}
        for index, record in enumerate(job.workers):
            if record.name not in staying and index < len(self.iterators):
                self.iterators[index] = None
        for device in set(self.worker_devices) - set(devices):
            self.fns.forget_worker(device)
        known = {r.name for r in job.workers}
        self._resize_connection(tuple(sorted(leaving)), [r.name for r in workers if r.name not in known])
        per_worker = self.options.per_worker_batch
        batch = per_worker * len(workers) if self.options.strategy.elastic_batch == "per-worker" else self.options.batch_size
        job.options = validate(replace(self.options, num_workers=len(workers), batch_size=batch))
        with self._pipelines:  # a re-hosting's new pipeline lands in the list the job goes on with, not in one it drops
            job.workers, self.worker_devices = workers, devices
            # a worker being re-hosted gets its pipeline when it is back (rebuild_worker): not on its lost server now
            self.iterators = [self.iterators[i] if job.supervisor.rehosting(r.name) else self._make_iterator(i)
                              for i, r in enumerate(workers)]
        return True
