"""``wb.train``: the public entry point of distributed training."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..cluster.process import connection
from ..errors import ConfigurationError
from .allreduce import AllReduceJob
from .evaluation import check_validation_data
from .fit import FitArguments, check_callbacks
from .job import Job
from .options import TrainOptions, resolve_epochs, validate
from .ps_job import PsJob


def train(
    cluster,
    model: Any,
    data: Callable,
    loss: Any,
    optimizer: Any = "adam",
    *,
    metrics: list | tuple = (),
    strategy: str = "async-ps",
    backup_workers: int = 0,
    steps: int | None = None,
    epochs: int | None = None,
    steps_per_epoch: int | None = None,
    batch_size: int = 64,
    steps_per_call: int = 10,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    seed: int | None = None,
    step_timeout: float = 300.0,
    partition_bytes: int = 16 * 2**20,
    telemetry: bool = True,
    recover: bool = True,
    hang_timeout: float = 30.0,
    on_hang: str | None = None,
    straggler_factor: float = 10.0,
    on_straggler: str = "wait",
    transfer: str = "fp32",
    elastic_batch: str = "per-worker",
    validation_data: Any = None,
    validation_steps: int | None = None,
    validation_freq: int = 1,
    callbacks: list | None = None,
    log_dir: str | None = None,
    wait: bool = False,
    queue: bool = True,
) -> Job:
    """Train a Keras model on ``cluster`` with the workbench's own distributed training loop.

    Keras 3's ``model.fit`` does not run under TensorFlow's parameter-server or multi-worker
    strategies; this loop does, with Keras models, losses and optimizers.

    Parameters
    ----------
    cluster:
        a running ``wb.Cluster``.
    model:
        a function returning a ``keras.Model`` (or a functional/Sequential model to clone); its
        variables are created on the ps tasks, spread by size.
    data:
        ``data(ctx) -> tf.data.Dataset`` of unbatched ``(features, labels)`` examples; ``ctx`` is a
        ``wb.DataContext`` (worker index, number of workers, per-worker batch, seed). The pipeline is
        built and run on each worker; the workbench repeats, batches and shards it.
    loss, optimizer, metrics:
        Keras loss (name, object or function), optimizer (name, object or
        factory), and per-batch metrics (``"accuracy"``, ``"mae"``, ``"mse"`` or functions).
    strategy:
        ``"async-ps"`` (each worker applies its own updates), ``"sync-ps"`` (each step averages
        the first N - ``backup_workers`` gradients and drops the late ones), or ``"allreduce"``
        (MultiWorkerMirroredStrategy on the worker engines: every step all-reduces every worker's
        gradient; no ps needed; ``model``, ``data`` and functions are sent to the engines by value).
        A placed model (``wb.place``) trains model-parallel: pass it as ``model`` and no strategy,
        or call ``placed.train(...)``.
    steps, epochs, steps_per_epoch, batch_size:
        as in Keras: ``epochs`` (default 1) of ``steps_per_epoch`` optimizer steps each (default: one pass of
        the training data, when its dataset says how many examples it has); or ``steps`` in all (default
        1000, one epoch). ``batch_size`` is the global batch (split evenly over the workers).
    validation_data, validation_steps, validation_freq:
        as in Keras: at the end of every ``validation_freq``-th epoch, the loss and metrics of
        ``validation_data`` (a data function like ``data``, run on every worker at once, each its share of
        the batches; or a ``tf.data.Dataset``, run in this kernel) on the trained variables where they live,
        over one pass of it or its first ``validation_steps`` batches; passed to the callbacks as ``val_*``.
    callbacks:
        ``keras.callbacks.Callback`` objects, called in this kernel as ``model.fit`` calls them
        (``on_train_begin/end``, ``on_epoch_begin/end`` with the epoch's mean loss and metrics and the
        ``val_*`` values, ``on_train_batch_begin/end`` once per remote call with its newest step's loss and
        metrics). ``callback.model`` is a Keras model holding the trained values at that moment: in the ps
        strategies and for placed models the job's own model, whose variables live on the tasks (what a
        callback reads is read there, only when it reads it; what it sets, weights or the optimizer's
        learning rate, is set there); in all-reduce a local copy, fetched from worker 0 when a callback reads
        it and sent back to every worker if the callback changed it. So ``ModelCheckpoint``,
        ``EarlyStopping(restore_best_weights=True)``, ``TensorBoard``, ``CSVLogger``, ``LearningRateScheduler``,
        ``ReduceLROnPlateau`` and ``model.stop_training = True`` work as with ``model.fit``; a job a callback
        stopped finishes at the end of that epoch (``job.stopped_early``). ``job.keras_history`` is the
        ``keras.callbacks.History``.
    log_dir:
        a TensorBoard log directory (default: the ``TensorBoard`` callback's): the job adds one run per
        worker with what only a distributed job has (examples/s and step time per worker, staleness in
        async-ps, dropped gradients in sync-ps, bytes moved per step, faults as text events).
        ``pip install tensorboard`` to use it.
    steps_per_call:
        steps a worker runs per remote call, in every strategy (fewer round trips).
    checkpoint_dir, checkpoint_every, resume:
        periodic ``tf.train.Checkpoint`` of model, optimizer and
        step (named ``ckpt-<step>``; in async-ps taken within ``steps_per_call`` x workers steps after each
        multiple, and always at the end); ``resume=True`` continues from the newest one.
    seed:
        makes initial weights and data order reproducible.
    step_timeout:
        seconds a sync-ps step may wait for its gradients (then the job fails), or an
        async-ps or allreduce remote call may run (an async-ps worker that stalls longer is given
        up on and its steps re-run elsewhere; allreduce fails, as every worker waits for it).
    partition_bytes:
        ps strategies: a variable this large or larger (e.g. a big embedding) is split
        along its first axis over the ps tasks, each shard updated on its own ps; 0 never splits.
        ``job.info["partitioned"]`` lists the split variables.
    telemetry:
        record step spans and completed steps into ``cluster.telemetry`` for the dashboards
        (``wb.dashboard``). The timings come back with the results of calls the job makes anyway.
    recover:
        when a task is lost (its engine killed, OOM, pre-empted) the workbench starts a new engine,
        re-hosts the same task at the same address, and the job takes it back: a lost worker's steps run
        on the others meanwhile (none is lost); a lost ps is restored from the newest checkpoint (at most
        one checkpoint interval is redone, counted in ``job.recoveries``); allreduce re-forms its group
        and resumes from the newest checkpoint. ``job.history`` marks each recovery, and
        ``job.faults`` lists what happened. ``recover=False`` keeps failing fast
        (``wb.ParameterServerLost``; an async-ps worker's steps still move to the others).
    hang_timeout, on_hang:
        a task that answers nothing (not even the reaper's ping) for ``hang_timeout``
        seconds is flagged (a ``wb.TaskFaultWarning``, the status table, panel and dashboard) and handled
        by ``on_hang``: ``"replace"`` (the default with ``recover``: kill and re-host it), ``"drop"``
        (leave it out: its steps run elsewhere; in sync-ps it counts like a late backup gradient) or
        ``"wait"`` (the default without ``recover``; ``step_timeout`` still bounds every wait).
    straggler_factor, on_straggler:
        a remote call running ``straggler_factor`` times longer than its
        peers' median (and at least a second) is flagged and handled by ``on_straggler`` (same policies;
        default ``"wait"``).
    transfer:
        ps strategies: the precision parameters (ps to worker) and gradients (worker to ps)
        travel in: ``"fp32"`` (as stored), ``"bf16"`` or ``"fp16"`` (half the bytes), ``"int8"`` (a
        quarter; each variable scaled by its largest magnitude, and what rounding loses of a gradient
        kept on its worker and added to the next one). Values are restored on arrival; variables
        and updates stay in their own precision. ``job.info["bytes_per_step"]`` says what a step moves.
    elastic_batch:
        async-ps and sync-ps follow ``cluster.scale(workers=N)`` while they train (at the next step
        boundary; ``job.events`` records each change). ``"per-worker"`` (default) keeps each worker's
        batch (``batch_size`` / workers at the start), so the global batch follows the number of
        workers; ``"global"`` keeps ``batch_size`` and splits it over the new number of workers (a scale
        to a number it does not divide by is refused). Either way every worker's input pipeline is made
        again with its new index and count: worker ``i`` of ``n`` reads shard ``i`` of ``n`` from its
        start. allreduce and placed models refuse a scale while they train.
    wait:
        block until the job ends (else it trains in the background; see ``job.wait()``). An interrupt
        (Jupyter's stop button) ends the wait, never the job: ``job.stop()`` stops it.
    queue:
        a cluster runs one job at a time. On a busy cluster the job is returned in state ``queued`` and
        begins when the jobs before it end (``cluster.jobs`` lists them; ``job.cancel()`` drops it);
        ``queue=False`` raises ``ClusterStateError`` instead, naming the running job.

    A job that begins at once is set up before ``wb.train`` returns (waited for at most 120 s plus
    ``step_timeout``, then a ``TimeoutError`` says the set-up goes on), so a mistake in the model, data or
    options is raised here; a queued job is set up when its turn comes (its error then comes from
    ``job.wait()``, and ``job.state`` is ``failed``).
    """
    # a placed model (wb.place) names the job that trains it: no import of the placing code, which calls train()
    placed_job = getattr(model, "job_class", None)
    if placed_job is not None:
        if strategy not in ("async-ps", "model-parallel"):
            raise ConfigurationError(
                f"a placed model (wb.place) trains with its layers on their tasks, not with strategy={strategy!r}: "
                "call placed.train(data, loss, ...) or wb.train without strategy.")
        strategy = "model-parallel"
    elif strategy == "model-parallel":
        raise ConfigurationError(
            "strategy='model-parallel' needs a placed model: placed = wb.place(make_model, {'layer': 'worker:0', ...}), "
            "then placed.train(data, loss, ...).")
    callbacks = check_callbacks(callbacks)
    check_validation_data(validation_data, validation_steps)
    steps, epochs, steps_per_epoch = resolve_epochs(
        steps, epochs, steps_per_epoch,
        _examples_in(data, seed) if epochs is not None and steps is None and steps_per_epoch is None else None,
        batch_size if isinstance(batch_size, int) and batch_size > 0 else 1)
    options = validate(TrainOptions(
        strategy=strategy, steps=steps, epochs=epochs, steps_per_epoch=steps_per_epoch,
        validation_steps=validation_steps, validation_freq=validation_freq, batch_size=batch_size, backup_workers=backup_workers,
        steps_per_call=steps_per_call, metrics=tuple(metrics), checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every, resume=resume, seed=seed, step_timeout=step_timeout, partition_bytes=partition_bytes,
        telemetry=bool(telemetry), recover=recover, hang_timeout=hang_timeout, on_hang=on_hang,
        straggler_factor=straggler_factor, on_straggler=on_straggler, transfer=transfer, elastic_batch=elastic_batch,
        num_workers=(len([t for t in cluster.tasks if t.job == "worker"])
                     if cluster.state == "running" and strategy != "model-parallel" else 1),
    ))
    if cluster.state != "running":
        from ..errors import ClusterStateError

        raise ClusterStateError(f"cannot train on cluster {cluster.name!r}: it is {cluster.state}. Call cluster.start() first.")
    job_class = placed_job or {"allreduce": AllReduceJob}.get(strategy, PsJob)
    fit = FitArguments(validation_data=validation_data, callbacks=callbacks, log_dir=log_dir)
    connection.prepare_process()  # once per process, while wb.train's caller waits (not in the job's thread)
    job = job_class(cluster, model, data, loss, optimizer, options, fit).start(queue=queue)
    if job.state != "queued":
        job.wait_set_up()
    return job.wait() if wait else job


def _examples_in(data: Callable, seed: int | None) -> int | None:
    """How many examples one pass of the training data has, if its dataset says so (for ``epochs`` alone)."""
    import tensorflow as tf

    from .data import DataContext

    dataset = data(DataContext(0, 1, 1, 0 if seed is None else seed))
    if not isinstance(dataset, tf.data.Dataset):
        return None  # the job's set-up says what is wrong with it
    count = int(dataset.cardinality())
    return count if count > 0 else None
