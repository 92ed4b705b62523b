"""The engine side of ``strategy="allreduce"``: MultiWorkerMirroredStrategy run on the worker engines.

Every worker engine runs the same code (SPMD): it builds the model under the strategy, runs its own
shard of the input, and all-reduces the gradients with the other workers each step. The kernel
only tells the engines how many steps to run next (a few calls of steps in one request), and collects what
they measured.

The strategy lives as long as the engine: TensorFlow cannot re-create it with other peers in a
running process (that hangs), so an engine joins one all-reduce group for its lifetime.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

from ....cluster.machine import memory, threads
from ....compat import tensorflow as tf_compat

_GROUP: dict[str, Any] = {"strategy": None, "key": None, "workers": None, "index": None}
_RUNS: dict[str, dict] = {}
# The last job's program on this engine: its variables under the strategy, its step functions, what it is (``key``).
# A later job of the same program (a cell run again, a sweep over seeds or learning rates) trains them again, set to
# its own initial values: tracing the step function took 0.3-0.6 s of a later digits-MLP job's 0.6 s set-up.
_PROGRAM: dict[str, Any] = {}


def unpack(payload: bytes) -> tuple:
    """The objects ``allreduce.portable`` packed: Keras objects are rebuilt from their configs."""
    import cloudpickle

    return tuple(item[1](item[2]) if item[0] == "rebuild" else item[1] for item in cloudpickle.loads(payload))


def join_group(workers: list[str], index: int, key: list[str]) -> dict:
    """Create (or reuse) this engine's strategy for the all-reduce group ``workers``; collective.

    ``key`` names the group by its members' TF tasks and their processes: a later job over the same
    engines reuses it (a member re-hosted since is a new process: ``WorkerGroup.stale`` then re-hosts the rest).
    """
    import tensorflow as tf

    if _GROUP["strategy"] is not None:
        if _GROUP["key"] == key:
            return {"ok": True, "reused": True, "replicas": _GROUP["strategy"].num_replicas_in_sync,
                    "program": _PROGRAM.get("owner")}
        return {"ok": False, "error": (
            f"this engine already all-reduces with {_GROUP['workers']}, and TensorFlow cannot change the group of a "
            "running process")}
    threads.apply_to_context()  # the group's own server and pools, as the tasks' (``machine.threads``)
    tf_compat.untuned_device_prefetch()  # the jobs' input reaches the replicas through it, and then goes at once
    resolver = group_resolver(workers, index, len(tf.config.list_physical_devices("GPU")))
    strategy = tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    # the per-device input of every job and SPMD cell on this engine would fix glibc's mmap threshold at 128 KiB, for
    # the process's life, the first time: done now and undone, for the same life (``machine.memory``)
    tf_compat.generator_malloc_setting_now()
    memory.keep_large_blocks_in_heap()
    _GROUP.update(strategy=strategy, key=list(key), workers=list(workers), index=index)
    # for code run on the workers directly (``%%wb spmd``): what TF's own multi-worker code reads
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": list(workers)}, "task": {"type": "worker", "index": index}})
    return {"ok": True, "reused": False, "replicas": strategy.num_replicas_in_sync, "program": None}


def group_resolver(workers: list[str], index: int, gpus: int):
    """The cluster resolver of worker ``index`` of the group ``workers``, which sees ``gpus`` GPUs.

    MultiWorkerMirroredStrategy puts a worker's replicas on the accelerators its resolver names, and a
    ``SimpleClusterResolver`` names none unless told: the replica of a GPU worker then ran on its CPU
    (seen on an H100: 135 ms a ResNet-10 step, 9.8 once the GPU was named).
    """
    import tensorflow as tf

    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": workers}), task_type="worker", task_id=index, rpc_layer="grpc",
        num_accelerators={"GPU": gpus} if gpus else None)


def group_key() -> list[str] | None:
    """The key of the group this engine joined (``join_group``), or None: it has none yet."""
    return _GROUP["key"] if _GROUP["strategy"] is not None else None


def spmd_names() -> dict:
    """The names an SPMD cell sees on a worker engine."""
    return {"strategy": _GROUP["strategy"], "worker_index": _GROUP["index"], "num_workers": len(_GROUP["workers"] or [])}


def _run(run_id: str) -> dict:
    """Job ``run_id``'s state on this engine; a later all-reduce job on these engines released it (one at a time)."""
    run = _RUNS.get(run_id)
    if run is None:
        raise LookupError("this all-reduce job's variables were released when a later all-reduce job started on these "
                          "engines (they hold one job's at a time): evaluate a job, or read job.model, before training "
                          "the next one")
    return run


def prepare(run_id: str, payload: bytes, settings: dict) -> dict:
    """Build (or take again: ``_PROGRAM``) the model, optimizer and step function of one job on this engine, and its
    input."""
    import tensorflow as tf

    from ...data import DataContext, example_spec, training_dataset

    strategy = _GROUP["strategy"]
    model_source, data, loss, optimizer, metrics = unpack(payload)
    index, num_workers = settings["index"], settings["num_workers"]
    local_replicas = strategy.num_replicas_in_sync // num_workers
    if settings["per_worker_batch"] % local_replicas:
        raise ValueError(
            f"this worker has {local_replicas} GPUs, one replica on each, and its batch of {settings['per_worker_batch']} "
            f"does not split evenly among them: choose a batch_size that is a multiple of {local_replicas * num_workers} "
            "(workers x GPUs per worker)")
    per_replica = settings["per_worker_batch"] // local_replicas
    example = tf.zeros(*example_spec(data, DataContext(index, num_workers, 1, settings["seed"])))
    sources = (model_source, loss, optimizer, metrics)
    program = _program_again(sources, example, settings)
    reused = program is not None
    if not reused:
        program = _new_program(run_id, sources, example, settings)
    fns, step = program["fns"], program["step"]
    dataset = strategy.distribute_datasets_from_function(
        lambda _input_context: training_dataset(data, DataContext(index, num_workers, per_replica, settings["seed"])))
    checkpoint = tf.train.Checkpoint(model=fns.model, optimizer=fns.optimizer, step=step)
    start_step = 0
    if settings["checkpoint"] is not None:  # the one the kernel names
        checkpoint.restore(settings["checkpoint"]).expect_partial()
        start_step = int(step.numpy())
    _release_runs()  # one job at a time per engine (already done where the program was taken again)
    _RUNS[run_id] = {"fns": fns, "model": fns.model, "step": step, "checkpoint": checkpoint, "iterator": iter(dataset),
                     "train_steps": program["train_steps"], "settings": settings, "gradients": []}
    return {"ok": True, "start_step": start_step, "replicas": strategy.num_replicas_in_sync, "per_replica_batch": per_replica,
            "metric_names": list(fns.metric_fns), "device": replica_device(strategy), "reused_step_function": reused}


def _new_program(run_id: str, sources: tuple, example, settings: dict) -> dict:
    """The job's model, optimizer and step function, built under the strategy; kept as ``_PROGRAM``, job ``run_id``'s."""
    import keras
    import tensorflow as tf

    from ...modelling.building import build_model, build_optimizer, seed_initializers
    from ...modelling.losses import resolve_loss, resolve_metrics
    from ...modelling.steps import StepFunctions, stamp_after, steps_in_one_call

    strategy = _GROUP["strategy"]
    model_source, loss, optimizer, metrics = sources
    if settings["seeded"]:
        seed_initializers(settings["seed"])
    with strategy.scope():
        model = build_model(model_source, example)
        opt = build_optimizer(optimizer)
        opt.build(model.trainable_variables)
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="workbench_step")
    fns = StepFunctions(model, opt, resolve_loss(loss), resolve_metrics(metrics))
    n_metrics = len(fns.metric_fns)
    replicas = strategy.num_replicas_in_sync

    # A keras.losses.Loss divides itself by the number of replicas under a strategy; plain loss
    # functions do not. Undo it, so that the loss is the batch mean either way.
    scaled_by_keras = isinstance(fns.loss_fn, keras.losses.Loss) and fns.loss_fn.reduction in (
        "sum_over_batch_size", "mean", "mean_with_sample_weight")
    unscale = float(replicas) if scaled_by_keras else 1.0

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss_value, metric_values = fns.forward(x, y, training=True)
            loss_value = loss_value * unscale
            total = loss_value + sum(model.losses) if model.losses else loss_value
            scaled = total / replicas  # Keras sums the gradients over the replicas
        grads = tape.gradient(scaled, model.trainable_variables)
        mark = stamp_after([loss_value, *grads])  # gradients ready here; all-reduce and apply follow
        with tf.control_dependencies([mark]):
            opt.apply_gradients(zip(grads, model.trainable_variables))
        # the step ends once every variable holds its update (a read of a variable runs after the writes before it):
        # stamped after the loss alone, the all-reduce and update fell into the next step's compute on the timeline
        applied = stamp_after([tf.identity(v.value) for v in model.trainable_variables])
        return loss_value, tf.stack(metric_values) if metric_values else tf.zeros([0]), mark, applied

    def one_step(x, y, state):  # no state of a worker's own: every replica's variables are the strategy's
        loss_value, metric_value, mark, applied = strategy.run(replica_step, args=(x, y))
        local = strategy.experimental_local_results
        # this worker's mean over its replicas: the kernel averages the workers' (equal batches), so the steps
        # need no collective beyond the gradients' all-reduce
        return (tf.reduce_mean(tf.stack(local(loss_value))), tf.reduce_mean(tf.stack(local(metric_value)), axis=0),
                list(local(applied)), local(mark)[0], None)

    if _PROGRAM:  # another program's step function goes: so do the kernels cached for it
        _PROGRAM.clear()
        tf_compat.clear_kernel_cache()
    _PROGRAM.update(owner=run_id, key=_program_key(fns), fns=fns, step=step, train_steps=steps_in_one_call(one_step, n_metrics))
    return _PROGRAM


def _program_again(sources: tuple, example, settings: dict) -> dict | None:
    """``_PROGRAM`` set to this job's initial values where the job's program is the same (``_program_key``) and the
    kernel saw every worker keep the same job's (``settings["program"]``: they all decide alike, as the strategy's
    variables are made together); else None. The values come from the job's model and optimizer built outside the
    strategy, seeded as a job's own: by ``seed``, or by the kernel's draw for the job (``init_seed``), which every
    worker shares."""
    from ...modelling.building import build_model, build_optimizer, seed_initializers
    from ...modelling.losses import resolve_loss, resolve_metrics
    from ...modelling.steps import StepFunctions

    if not _PROGRAM or _PROGRAM["key"] is None or _PROGRAM["owner"] != settings["program"]:
        return None
    model_source, loss, optimizer, metrics = sources
    seed_initializers(settings["seed"] if settings["seeded"] else settings["init_seed"])
    model = build_model(model_source, example)  # outside the strategy's scope: plain variables of this process
    opt = build_optimizer(optimizer)
    opt.build(model.trainable_variables)
    if _program_key(StepFunctions(model, opt, resolve_loss(loss), resolve_metrics(metrics))) != _PROGRAM["key"]:
        return None
    _release_runs()  # the last job's variables are this job's from here on
    kept = _PROGRAM["fns"]
    kept.model.set_weights(model.get_weights())
    for mine, initial in zip(kept.optimizer.variables, opt.variables, strict=True):
        mine.assign(initial)
    _PROGRAM["step"].assign(0)
    return _PROGRAM


def _program_key(fns) -> tuple | None:
    """What decides the step function besides its variables' values (``reuse.program_key``), where the variables'
    place is left out: a job's own are built outside the strategy, to compare. None (never taken again) where that
    cannot be told."""
    from ...modelling.reuse import program_key

    try:
        layout = tuple((tuple(v.shape), str(getattr(v.dtype, "name", v.dtype)), bool(v.trainable))
                       for v in [*fns.model.weights, *fns.optimizer.variables])
        return program_key(fns, [], (layout,))
    except Exception:  # noqa: BLE001 - an optimisation: a program it cannot tell trains as a new one
        return None


def _release_runs() -> None:
    for earlier in _RUNS.values():
        _release(earlier)
    _RUNS.clear()


def replica_device(strategy) -> str:
    """Where this engine's (first) replica computes, as ``GPU:0`` or ``CPU:0``: the strategy chose it."""
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(strategy.extended.worker_devices[0])
    return f"{spec.device_type or 'CPU'}:{spec.device_index or 0}"


def run_steps(run_id: str, calls: list[int]) -> list[dict]:
    """Run calls of synchronous steps, ``calls[i]`` steps the i-th, one after the other; every worker of the group
    must run the same. Each call's losses and metrics are this worker's (the mean over its replicas); the kernel
    averages the workers'."""
    import tensorflow as tf

    run = _run(run_id)
    answers = []
    with tf_compat.gradient_registrations(run["gradients"]):  # the first call traces: its all-reduce registers one
        for n in calls:
            losses, metrics, stamps, marks = run["train_steps"](run["iterator"], tf.constant(n, tf.int32), (), ())
            answers.append({"losses": losses.numpy().tolist(), "metrics": metrics.numpy().tolist(),
                            "stamps": stamps.numpy().tolist(), "marks": marks.numpy().tolist()})
    return answers


def finish(run_id: str) -> bool:
    """The job is over: drop its input pipeline and step function, keep the model for evaluate and weights.

    Then return the freed memory to the system (a memory-capped container counts what the process keeps).
    """
    import gc

    run = _RUNS.get(run_id)
    if run is not None:
        _release(run)
    gc.collect()
    return memory.trim_memory()


def _release(run: dict) -> None:
    """Drop a job's input pipeline, the gradient functions its traces registered with TensorFlow, which would keep
    their graphs alive, and, where it made functions of its own (validation, evaluation: new ones every job), the
    kernels the eager runtime cached for them: see ``compat.tensorflow``. The step function stays with the program
    (``_PROGRAM``); its traces need no registration once made."""
    run.pop("iterator", None)
    run.pop("train_steps", None)
    run.pop("validation", None)
    tf_compat.forget_gradients(run["gradients"])
    if run.pop("own_functions", False):
        tf_compat.clear_kernel_cache()


def save(run_id: str, checkpoint_dir: str, step: int, keep: int) -> str | None:
    """Checkpoint collectively: worker 0 writes ``checkpoint_dir``, the others a scratch copy."""
    import tensorflow as tf

    run = _run(run_id)
    run["step"].assign(step)
    chief = run["settings"]["index"] == 0
    target = checkpoint_dir if chief else tempfile.mkdtemp(prefix="workbench-ckpt-")
    try:
        return tf.train.CheckpointManager(run["checkpoint"], target, max_to_keep=keep).save(checkpoint_number=step)
    finally:
        if not chief:
            shutil.rmtree(target, ignore_errors=True)


def evaluate(run_id: str, payload: bytes, batch_size: int) -> dict:
    """Loss and metrics over one pass of the evaluation data, on this engine's copy of the weights."""
    import tensorflow as tf

    from ...data import evaluation_dataset

    run = _run(run_id)
    (data,) = unpack(payload)
    fns, seed = run["fns"], run["settings"]["seed"]
    evaluate = fns.evaluation_function(tf.autograph.experimental.do_not_convert(lambda: evaluation_dataset(data, batch_size, seed)))
    run["own_functions"] = True
    with tf_compat.gradient_registrations(run["gradients"]):  # a custom gradient of the model's, traced
        values, count = evaluate()
    return {"values": values.numpy().tolist(), "count": int(count.numpy())}


def validate(run_id: str, payload: bytes, steps: int | None) -> dict:
    """This worker's share of a validation pass (its shard; of ``steps`` batches in all, if given)."""
    import tensorflow as tf

    from ...data import DataContext, validation_dataset

    run = _run(run_id)
    settings, fns = run["settings"], run["fns"]
    function = run.get("validation")
    if function is None:
        (data,) = unpack(payload)
        ctx = DataContext(settings["index"], settings["num_workers"], settings["per_worker_batch"], settings["seed"],
                          training=False)
        function = run["validation"] = fns.evaluation_function(
            tf.autograph.experimental.do_not_convert(lambda: validation_dataset(data, ctx, steps)))
        run["own_functions"] = True
    with tf_compat.gradient_registrations(run["gradients"]):  # a custom gradient of the model's, traced
        values, count = function()
    return {"values": values.numpy().tolist(), "count": int(count.numpy())}


def state(run_id: str) -> dict:
    """The weights, learning rate (None for a schedule) and iteration count of this worker's replica."""
    from ...modelling.building import learning_rate_of

    run = _run(run_id)
    optimizer = run["fns"].optimizer
    return {"weights": [w.numpy() for w in run["model"].weights], "learning_rate": learning_rate_of(optimizer),
            "iterations": int(optimizer.iterations.numpy())}


def assign(run_id: str, weights: list | None, learning_rate: float | None) -> bool:
    """Set this worker's replicas to what a callback set in the kernel (every worker gets the same)."""
    run = _run(run_id)
    if weights is not None:
        run["model"].set_weights(weights)
    if learning_rate is not None:
        run["fns"].optimizer.learning_rate = learning_rate
    return True


def weights(run_id: str) -> list:
    return [w.numpy() for w in _run(run_id)["model"].weights]
