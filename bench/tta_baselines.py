"""TensorFlow's own ways to train to a target, for ``bench/time_to_accuracy.py``, each in processes of its own.

One process must not mix TensorFlow cluster connections (the bench's process is the workbench's client), so
each side runs as ``python bench/tta_baselines.py <kind> '<json config>'`` and hands back its ``TargetClock``
(``tta_workloads``): when it was called, when its first call of steps ended, and the held-out accuracy at each
epoch's end. Written as TensorFlow's guides write them:

- ``local``: one process, Keras ``compile`` (``steps_per_execution`` K) and ``fit``, the global batch;
- ``pss``: ``ParameterServerStrategy`` + ``ClusterCoordinator`` on the bench's baselines' cluster, a ``tf.function`` of K steps
  (a ``tf.range`` loop) scheduled per closure, ``coordinator.join()`` at each epoch's end; each worker reads its
  own shuffle of the data (unseeded, as the guide's ``dataset_fn``);
- ``mwms``: ``MultiWorkerMirroredStrategy`` with a custom loop (K steps per ``tf.function``, the loss averaged over
  the global batch with ``tf.nn.compute_average_loss``), one process per worker on ports of its own (loopback);
  every worker judges the same mirrored weights, so all stop at the same epoch; each worker takes its share of every
  batch of one shuffled stream (batched, then sharded), so that the global batches are those one process draws;
- ``sync-replicas``: TF1 between-graph replication with ``SyncReplicasOptimizer`` (``replicas_to_aggregate``
  N - k), one ``MonitoredTrainingSession`` client per worker task of the bench's baselines' cluster; the chief judges the
  variables every ``epoch_steps`` global steps. With backup workers (k > 0) the others need no gradient of the
  chief's to go on, so they would train on while the chief judges, off the clock: every side's other workers wait
  during its judging (the workbench's at the epoch's end, PSS's at ``join()``, MWMS's in the next all-reduce), and
  so do these, told by a file (``PausedPeers``). With k = 0 they wait for the chief's gradient anyway.

One process and MWMS seed as ``wb.train(seed=...)`` does (``seed_initializers``: Keras's initializers from the seed,
TensorFlow's global seed left unset, which a ``shuffle(seed=...)`` would pair its own with): for a given seed they
train the steps all-reduce and sync-ps k=0 train, from the same weights on the same batches, and reach the target
at the same epoch. The processes route TensorFlow's listening sockets through the workbench's bind shim (loopback only).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from training_baselines import BaselineError, _tail_file, _terminate, run_chief_first, run_one, sync_replicas_graph, tf1_session
from tta_workloads import TargetClock, arrays, filters, keras_model

from workbench.cluster.machine import threads
from workbench.training.modelling.building import seed_initializers

SCRIPT = str(Path(__file__).resolve())


# ---------------------------------------------------------------- bench side


def run_local(config: dict, timeout: float) -> dict:
    return run_one("local", "one-process baseline", config, timeout, SCRIPT)


def run_pss(spec: dict, config: dict, timeout: float) -> dict:
    return run_one("pss", "ParameterServerStrategy baseline", {**config, "spec": spec}, timeout, SCRIPT)


def run_sync_replicas(spec: dict, config: dict, backup_workers: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="wb-bench-tta-") as tmp:
        tmp_path = Path(tmp)
        container = "tta" + os.urandom(6).hex()  # fresh queues and variables on the cluster's tasks
        configs = [{**config, "spec": spec, "index": index, "backup_workers": backup_workers, "container": container,
                    "result": str(tmp_path / "result.json"), "pause": str(tmp_path / "pause")}
                   for index in range(len(spec["worker"]))]
        run_chief_first("sync-replicas", configs, tmp_path, timeout, grace=2.0, script=SCRIPT)
        return json.loads((tmp_path / "result.json").read_text())


def run_mwms(workers: int, config: dict, timeout: float) -> dict:
    """``workers`` processes, one MultiWorkerMirroredStrategy worker each; worker 0's clock."""
    addresses = [f"127.0.0.1:{port}" for port in _free_ports(workers)]
    with tempfile.TemporaryDirectory(prefix="wb-bench-mwms-") as tmp:
        tmp_path = Path(tmp)
        procs = []
        try:
            for index in range(workers):
                with open(tmp_path / f"worker{index}.stderr", "w") as stderr:
                    payload = json.dumps({**config, "workers": addresses, "index": index,
                                          "result": str(tmp_path / f"result{index}.json")})
                    procs.append(subprocess.Popen([sys.executable, SCRIPT, "mwms", payload], stdin=subprocess.DEVNULL,
                                                  stdout=subprocess.DEVNULL, stderr=stderr))
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs):
                failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    index = failed[0] if failed else 0
                    why = f"failed (exit {procs[index].returncode})" if failed else f"ran past {timeout:.0f} s"
                    raise BaselineError(f"MultiWorkerMirroredStrategy worker {index} {why}:\n"
                                        f"{_tail_file(tmp_path / f'worker{index}.stderr')}")
                time.sleep(0.05)
        finally:
            for proc in procs:
                _terminate(proc)
        return json.loads((tmp_path / "result0.json").read_text())


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


# ---------------------------------------------------------------- baseline processes


def _protect() -> None:
    """TensorFlow's listening sockets on loopback, as the workbench's own processes have them."""
    from workbench.cluster.process.bind_hook import protect_or_reason

    reason = protect_or_reason()
    if reason:
        print(f"warning: TensorFlow's ports are not held to loopback: {reason}", file=sys.stderr)


def _report(clock: TargetClock, config: dict, **extra) -> None:
    text = json.dumps(clock.result(**extra))
    if config.get("result"):
        Path(config["result"]).write_text(text)
    print("RESULT " + text, flush=True)


def _optimizer(keras, config: dict):
    return keras.optimizers.Adam(config["learning_rate"])


def local_main(config: dict) -> None:
    import keras
    import tensorflow as tf

    workload, k = config["workload"], config["steps_per_call"]
    x, y = arrays(workload, "train")
    seed_initializers(config["seed"])
    clock = TargetClock(workload, config["target"])
    clock.call = time.time()
    model = keras_model(workload, config["width"])
    model.compile(optimizer=_optimizer(keras, config), steps_per_execution=k,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(y), seed=config["seed"]).repeat()
    dataset = dataset.batch(config["global_batch"], drop_remainder=True).prefetch(tf.data.AUTOTUNE)
    model.fit(dataset, epochs=config["max_epochs"], steps_per_epoch=config["epoch_steps"], verbose=0,
              callbacks=[clock.keras_callback()])
    _report(clock, config)


def pss_main(config: dict) -> None:
    import keras
    import tensorflow as tf

    _protect()
    threads.apply_to_context()  # this process's pools, and its contexts on the tasks, as the workbench's client sets them
    workload, k, batch = config["workload"], config["steps_per_call"], config["per_worker_batch"]
    x, y = arrays(workload, "train")
    keras.utils.set_random_seed(config["seed"])
    clock = TargetClock(workload, config["target"])
    clock.call = time.time()
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec(config["spec"]), rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = keras_model(workload, config["width"])
        optimizer = _optimizer(keras, config)
        optimizer.build(model.trainable_variables)  # slots on the ps now, not in the first traced step
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables

    def dataset_fn(_context):
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(y)).repeat()
        return dataset.batch(batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    iterator = iter(coordinator.create_per_worker_dataset(lambda: strategy.distribute_datasets_from_function(dataset_fn)))

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

    train_steps = steps_function(tf, strategy, replica_step, k)
    calls = -(-config["epoch_steps"] // k)
    for _ in range(config["max_epochs"]):
        scheduled = [coordinator.schedule(train_steps, args=(iterator,)) for _ in range(calls)]
        if clock.first is None:
            scheduled[0].fetch()
            clock.batch_end()
        coordinator.join()
        if clock.epoch_end(model.get_weights):
            break
    _report(clock, config)


def steps_function(tf, strategy, replica_step, k: int):
    """``k`` steps of ``replica_step`` in one ``tf.function`` (a ``tf.range`` loop), as TensorFlow's guides pack them."""

    @tf.function
    def train_steps(iterator):
        for _ in tf.range(k):
            strategy.run(replica_step, args=next(iterator))

    return train_steps


def mwms_main(config: dict) -> None:
    import keras
    import tensorflow as tf

    _protect()
    workload, k, index = config["workload"], config["steps_per_call"], config["index"]
    x, y = arrays(workload, "train")
    seed_initializers(config["seed"])
    clock = TargetClock(workload, config["target"])
    clock.call = time.time()
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": config["workers"]}), task_type="worker", task_id=index, rpc_layer="grpc")
    strategy = tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    global_batch = config["global_batch"]
    with strategy.scope():
        model = keras_model(workload, config["width"])
        optimizer = _optimizer(keras, config)
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    variables = model.trainable_variables

    def dataset_fn(context):  # batches, then each worker its share of them: each global batch as one process's
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(y), seed=config["seed"]).repeat()
        dataset = dataset.batch(context.get_per_replica_batch_size(global_batch), drop_remainder=True)
        return dataset.shard(context.num_input_pipelines, context.input_pipeline_id).prefetch(tf.data.AUTOTUNE)

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_fn(yb, model(xb, training=True)), global_batch_size=global_batch)
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))  # summed over the replicas

    train_steps = steps_function(tf, strategy, replica_step, k)
    calls = -(-config["epoch_steps"] // k)
    for _ in range(config["max_epochs"]):
        for _ in range(calls):
            train_steps(iterator)
            if clock.first is None:
                clock.batch_end()
        if clock.epoch_end(model.get_weights):
            break
    _report(clock, config)


def sync_replicas_main(config: dict) -> None:
    import tensorflow as tf

    v1 = tf.compat.v1
    v1.disable_eager_execution()  # Keras 3 layers do not build in TF1 graphs: the models are written out below
    workload, epoch_steps = config["workload"], config["epoch_steps"]
    clock = TargetClock(workload, config["target"])
    clock.call = time.time()
    train_op, step_after, hooks, variables = sync_replicas_graph(
        tf, config, arrays(workload, "train"), lambda inputs: graph_model(v1, tf, workload, inputs, config["width"]),
        config["learning_rate"])
    sess = tf1_session(v1, config, hooks)
    peers = PausedPeers(config["pause"], len(config["spec"]["worker"]))
    if config["index"] != 0:
        try:
            while not sess.should_stop():  # until the chief has its answer and closes the token queue
                peers.wait_while_paused(config["index"])
                sess.run(train_op)
        except (tf.errors.OutOfRangeError, tf.errors.CancelledError):
            pass
        return
    epochs = 0
    while epochs < config["max_epochs"]:
        _, step = sess.run([train_op, step_after])
        clock.batch_end()
        if step >= (epochs + 1) * epoch_steps:
            epochs += 1
            with peers.paused(config["backup_workers"] > 0):
                reached = clock.epoch_end(lambda: sess.run(variables))
            if reached:
                break
    _report(clock, config)
    sess.close()


class PausedPeers:
    """The chief's judging, with the other SyncReplicas clients waiting between their steps (a file says so).

    A client that sees the ``pause`` file says it waits (``pause.<index>``) and waits until the file goes; the chief
    judges once every other client waits (the step each had in flight is done by then, and applied).
    """

    POLL = 0.001  # seconds
    LIMIT = 60.0  # seconds any wait here may take

    def __init__(self, path: str, clients: int):
        self.path, self.clients = Path(path), clients

    @contextlib.contextmanager
    def paused(self, needed: bool):
        if not needed:
            yield
            return
        self.path.touch()
        try:
            self._until(lambda: all(Path(f"{self.path}.{i}").exists() for i in range(1, self.clients)),
                        "every other SyncReplicas client to pause")
            yield
        finally:
            self.path.unlink()

    def wait_while_paused(self, index: int) -> None:
        if not self.path.exists():
            return
        waiting = Path(f"{self.path}.{index}")
        waiting.touch()
        try:
            self._until(lambda: not self.path.exists(), "the chief to end its judging")
        finally:
            waiting.unlink()

    def _until(self, done, what: str) -> None:
        deadline = time.monotonic() + self.LIMIT
        while not done():
            if time.monotonic() > deadline:
                raise BaselineError(f"waited {self.LIMIT:.0f} s for {what}")
            time.sleep(self.POLL)


def graph_model(v1, tf, workload: str, inputs, width: float):
    """``tta_workloads.keras_model`` written out for a TF1 graph: the same layers, initializers and weight order."""
    from training_baselines import _graph_mlp
    from tta_workloads import HIDDEN

    if workload == "mlp":
        return _graph_mlp(v1, tf, inputs, HIDDEN)
    out, channels = inputs, 1
    for layer, count in enumerate(filters(width)):
        kernel = v1.get_variable(f"conv{layer}/kernel", [3, 3, channels, count], initializer=v1.glorot_uniform_initializer())
        bias = v1.get_variable(f"conv{layer}/bias", [count], initializer=v1.zeros_initializer())
        out = tf.nn.relu(tf.nn.conv2d(out, kernel, 1, "VALID") + bias)
        out = tf.nn.max_pool2d(out, 2, 2, "VALID")
        channels = count
    flat = tf.reshape(out, [-1, int(out.shape[1]) * int(out.shape[2]) * channels])
    kernel = v1.get_variable("dense/kernel", [flat.shape[1], 10], initializer=v1.glorot_uniform_initializer())
    bias = v1.get_variable("dense/bias", [10], initializer=v1.zeros_initializer())
    return tf.matmul(flat, kernel) + bias


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")  # on a GPU the workbench's workers share: take what it needs
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    mains = {"local": local_main, "pss": pss_main, "mwms": mwms_main, "sync-replicas": sync_replicas_main}
    mains[sys.argv[1]](json.loads(sys.argv[2]))
