"""``wb.train``: the public entry point of distributed training."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..cluster.process import connection
from ..errors import ClusterStateError
from .config import Recovery, checkpoint_from, recovery_from, strategy_from
from .fit.evaluation import check_validation_data
from .fit.loop import FitArguments, check_callbacks
from .job.job import Job
from .job.trainer import JobInputs
from .modelling.building import compiled_settings
from .moved import refusing_moved_arguments
from .options import TrainOptions, resolve_epochs, validate
from .strategies import trainer_class


@refusing_moved_arguments("wb.train")
def train(
    cluster,
    model: Any,
    data: Callable,
    loss: Any = None,
    optimizer: Any = None,
    *,
    metrics: list | tuple | None = None,
    strategy: Any = None,
    steps: int | None = None,
    epochs: int | None = None,
    steps_per_epoch: int | None = None,
    batch_size: int = 64,
    validation_data: Any = None,
    validation_steps: int | None = None,
    validation_freq: int = 1,
    callbacks: list | None = None,
    checkpoint: Any = None,
    recovery: Recovery | None = Recovery(),  # noqa: B008 - frozen: one shared default is safe
    seed: int | None = None,
    telemetry: bool = True,
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
        a function returning a ``keras.Model`` (or a functional/Sequential model to clone), or a placed
        model (``wb.place``); its variables are created on the ps tasks, spread by size.
    data:
        ``data(ctx) -> tf.data.Dataset`` of unbatched ``(features, labels)`` examples; ``ctx`` is a
        ``wb.DataContext`` (worker index, number of workers, per-worker batch, seed). The pipeline is
        built and run on each worker; the workbench repeats, batches and shards it.
    loss, optimizer, metrics:
        Keras loss (name, object or function), optimizer (name, object, config or factory), and per-batch
        metrics (``"accuracy"``, ``"mae"``, ``"mse"`` or functions). As with ``compile`` then ``fit``: each one
        left out is the compiled model's when ``model`` returns a compiled one, else (optimizer) ``"adam"``
        and (metrics) none; a loss is then needed. Given both, the call's arguments win.
    strategy:
        how the workers train together, an object carrying the options that mean something for it alone:
        ``wb.AsyncPS(...)`` (each worker applies its own updates; the default), ``wb.SyncPS(backup_workers=...)``
        (each step averages the first N - ``backup_workers`` gradients and drops the late ones),
        ``wb.AllReduce()`` (MultiWorkerMirroredStrategy on the worker engines; no ps needed; ``model``, ``data``
        and functions are sent to the engines by value); or a name for its defaults: ``"async-ps"``,
        ``"sync-ps"``, ``"allreduce"``. A placed model (``wb.place``) trains model-parallel
        (``wb.ModelParallel``, its default); ``placed.train(...)`` says the same.
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
        ``EarlyStopping(restore_best_weights=True)``, ``CSVLogger``, ``LearningRateScheduler``,
        ``ReduceLROnPlateau`` and ``model.stop_training = True`` work as with ``model.fit``; a job a callback
        stopped finishes at the end of that epoch (``job.stopped_early``). ``job.keras_history`` is the
        ``keras.callbacks.History``. With a ``TensorBoard`` callback the job adds to its directory one run per
        worker with what only a distributed job has (examples/s and step time per worker, staleness in
        async-ps, dropped gradients in sync-ps, bytes moved per step, faults as text events).
    checkpoint:
        ``wb.Checkpoint(directory, every=..., resume=..., keep=...)``: periodic ``tf.train.Checkpoint`` of
        model, optimizer and step (``ckpt-<step>``), always at the end; a directory alone is
        ``wb.Checkpoint(directory)``. ``resume=True`` continues from the newest one.
    recovery:
        ``wb.Recovery(...)``: what the job does when a task is lost, hangs or straggles, and how long it waits
        (``rehost``, ``step_timeout``, ``hang_timeout``, ``on_hang``, ``straggler_factor``, ``on_straggler``).
        By default a lost task is re-hosted at the same address and the job takes it back (a lost ps from the
        newest checkpoint); ``job.faults`` lists what happened. ``None`` fails fast (``wb.ParameterServerLost``).
    seed:
        makes initial weights and data order reproducible.
    telemetry:
        record step spans and completed steps into ``cluster.telemetry`` for the dashboards
        (``wb.dashboard``). The timings come back with the results of calls the job makes anyway.
    queue:
        a cluster runs one job at a time. On a busy cluster the job is returned in state ``queued`` and
        begins when the jobs before it end (``cluster.jobs`` lists them; ``job.cancel()`` drops it);
        ``queue=False`` raises ``ClusterStateError`` instead, naming the running job.

    The job trains in the background: ``job.wait()`` blocks until it ends (an interrupt, Jupyter's stop
    button, ends the wait, never the job: ``job.stop()`` stops it). A job that begins at once is set up
    before ``wb.train`` returns (waited for at most 120 s plus ``step_timeout``, then a ``TimeoutError`` says
    the set-up goes on), so a mistake in the model, data or options is raised here; a queued job is set up
    when its turn comes (its error then comes from ``job.wait()``, and ``job.state`` is ``failed``).
    A keyword of an earlier version (``backup_workers=``, ``checkpoint_dir=``, ``wait=``...) raises a
    ``TypeError`` naming its new place.
    """
    strategy = strategy_from(strategy, placed=getattr(model, "placed", False) is True)  # a wb.place model
    callbacks = check_callbacks(callbacks)
    check_validation_data(validation_data, validation_steps)
    steps, epochs, steps_per_epoch = resolve_epochs(
        steps, epochs, steps_per_epoch,
        _examples_in(data, seed) if epochs is not None and steps is None and steps_per_epoch is None else None,
        batch_size if isinstance(batch_size, int) and batch_size > 0 else 1)
    loss, optimizer, metrics = compiled_settings(model, loss, optimizer, metrics)
    options = validate(TrainOptions(
        strategy=strategy, recovery=recovery_from(recovery), checkpoint=checkpoint_from(checkpoint), steps=steps,
        epochs=epochs, steps_per_epoch=steps_per_epoch, validation_steps=validation_steps, validation_freq=validation_freq,
        batch_size=batch_size, metrics=metrics, seed=seed, telemetry=bool(telemetry),
        num_workers=(len([t for t in cluster.tasks if t.job == "worker"])
                     if cluster.state == "running" and strategy.data_parallel else 1),
    ))
    if cluster.state != "running":
        raise ClusterStateError(f"cannot train on cluster {cluster.name!r}: it is {cluster.state}. Call cluster.start() first.")
    fit = FitArguments(validation_data=validation_data, callbacks=callbacks)
    connection.prepare_process()  # once per process, while wb.train's caller waits (not in the job's thread)
    job = Job(cluster, JobInputs(model, data, loss, optimizer), options, trainer_class(strategy), fit).start(queue=queue)
    if job.state != "queued":
        job.wait_set_up()
    return job


def _examples_in(data: Callable, seed: int | None) -> int | None:
    """How many examples one pass of the training data has, if its dataset says so (for ``epochs`` alone)."""
    import tensorflow as tf

    from .data import DataContext

    dataset = data(DataContext(0, 1, 1, 0 if seed is None else seed))
    if not isinstance(dataset, tf.data.Dataset):
        return None  # the job's set-up says what is wrong with it
    count = int(dataset.cardinality())
    return count if count > 0 else None
