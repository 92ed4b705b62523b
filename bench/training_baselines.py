"""Hand-written TensorFlow baselines for ``bench/training.py``, each run in processes of its own.

One process must not mix TensorFlow cluster connections (the bench's own process is the workbench's
client), so each baseline runs as ``python bench/training_baselines.py <kind> '<json config>'``
against the bench's running cluster, and hands back raw timings; ``bench/training.py`` turns every
side's timings into rates with one estimator.

- ``pss``: ``ParameterServerStrategy`` + ``ClusterCoordinator``. Each scheduled ``tf.function`` runs
  ``steps_per_call`` steps in a ``tf.range`` loop (TensorFlow's advice: pack several steps into one
  function) and returns one worker-side ``tf.timestamp()`` per step, taken after that step's update.
- ``sync-replicas``: TF1 between-graph replication with ``SyncReplicasOptimizer``, one client process
  per worker task, each a ``MonitoredTrainingSession`` on its worker's master. Each client appends
  ``(time, global step)`` after every step to a file (non-chief clients are terminated, see below).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from workbench.cluster.launch.reaper import kill_process_trees
from workbench.cluster.machine import threads

SCRIPT = str(Path(__file__).resolve())
LEARNING_RATE = 0.001
STDERR_TAIL = 3000


class BaselineError(RuntimeError):
    """A baseline process failed or ran past its time; the message carries the end of its stderr."""


# ---------------------------------------------------------------- bench side: launch and collect


def run_pss(spec: dict, *, steps: int, steps_per_call: int, per_worker_batch: int, hidden: int, seed: int,
            timeout: float) -> tuple[list[float], float]:
    """Worker-side end times of ``steps`` PSS + ClusterCoordinator steps, ``steps_per_call`` per closure, and
    when the client began to build them (after its ``import tensorflow``)."""
    config = {"spec": spec, "steps": steps, "steps_per_call": steps_per_call, "per_worker_batch": per_worker_batch,
              "hidden": hidden, "seed": seed}
    result = run_one("pss", "PSS baseline", config, timeout)
    return result["stamps"], result["start"]


def run_local(*, steps: int, steps_per_call: int, per_worker_batch: int, hidden: int, seed: int,
              timeout: float) -> dict:
    """The same training step in one process, no cluster: ``{"stamps": [...], "cpu": CpuSampler samples}``."""
    config = {"steps": steps, "steps_per_call": steps_per_call, "per_worker_batch": per_worker_batch, "hidden": hidden,
              "seed": seed}
    return run_one("local", "local baseline", config, timeout)


def run_one(kind: str, what: str, config: dict, timeout: float, script: str = SCRIPT) -> dict:
    """Run ``python script kind config``; its last ``RESULT`` line, parsed."""
    try:
        proc = subprocess.run([sys.executable, script, kind, json.dumps(config)], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise BaselineError(f"{what} ran past {timeout} s:\n{_tail(exc.stderr)}") from None
    results = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        raise BaselineError(f"{what} failed (exit {proc.returncode}):\n{_tail(proc.stderr)}")
    return json.loads(results[-1])


def run_sync_replicas(spec: dict, *, steps: int, backup_workers: int, per_worker_batch: int, hidden: int,
                      seed: int, timeout: float, grace: float = 5.0) -> tuple[list[tuple[float, int]], float]:
    """``(time, global step)`` after each step of every TF1 SyncReplicasOptimizer client, until global step ``steps``,
    and when the chief began to build its graph (after its ``import tensorflow``).

    The chief's session is created first: a non-chief that checks for initialized variables too early
    sleeps 30 s (SessionManager's ``recovery_wait_secs``) before it looks again. When the chief stops,
    a non-chief client still waiting for a token stays blocked for good (SyncReplicasOptimizer's known
    limit; in this bench's runs they usually reach the last step too): they get ``grace`` seconds to end
    by themselves, then are terminated.
    """
    workers = len(spec["worker"])
    container = "syncreplicas" + uuid.uuid4().hex[:12]  # fresh queues and variables; no underscores allowed
    with tempfile.TemporaryDirectory(prefix="wb-bench-syncreplicas-") as tmp:
        tmp_path = Path(tmp)
        configs = [{"spec": spec, "index": index, "steps": steps, "backup_workers": backup_workers,
                    "per_worker_batch": per_worker_batch, "hidden": hidden, "seed": seed, "container": container,
                    "points": str(tmp_path / f"worker{index}.points")} for index in range(workers)]
        run_chief_first("sync-replicas", configs, tmp_path, timeout, grace)
        points = []
        for index in range(workers):
            path = tmp_path / f"worker{index}.points"
            if path.exists():
                for line in path.read_text().splitlines():
                    stamp, step = line.split()
                    points.append((float(stamp), int(step)))
        return points, float((tmp_path / "worker0.points.start").read_text())


def run_chief_first(kind: str, configs: list[dict], tmp_path: Path, timeout: float, grace: float,
                    script: str = SCRIPT) -> None:
    """Run one TF1 client per config (``python script kind config``, stderr to ``tmp_path/worker<i>.stderr``) until
    the chief (the first) ends: the others are told to go (a line on their stdin) once the chief's session exists
    (it touches ``config["ready"]``, added here), get ``grace`` seconds after the chief to end by themselves, and are
    then terminated."""
    ready = tmp_path / "chief-ready"
    procs: list[subprocess.Popen] = []
    try:
        for index, config in enumerate(configs):
            with open(tmp_path / f"worker{index}.stderr", "w") as stderr:
                procs.append(subprocess.Popen([sys.executable, script, kind, json.dumps({**config, "ready": str(ready)})],
                                              stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=stderr, text=True))
        deadline = time.monotonic() + timeout
        _wait_until(lambda: ready.exists(), procs, tmp_path, deadline, "the chief's session to be created")
        for index, proc in enumerate(procs[1:], 1):
            try:
                proc.stdin.write("go\n")
                proc.stdin.close()
            except BrokenPipeError:
                raise BaselineError(f"SyncReplicas client {index} exited before its session was created:\n"
                                    f"{_tail_file(tmp_path / f'worker{index}.stderr')}") from None
        _wait_until(lambda: procs[0].poll() is not None, procs, tmp_path, deadline, "the chief to reach the last step")
        if procs[0].returncode != 0:
            raise BaselineError(f"SyncReplicas chief failed (exit {procs[0].returncode}):\n"
                                f"{_tail_file(tmp_path / 'worker0.stderr')}")
        end = time.monotonic() + grace
        for proc in procs[1:]:
            try:
                proc.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for proc in procs:
            _terminate(proc)


def _wait_until(done, procs: list[subprocess.Popen], tmp_path: Path, deadline: float, what: str) -> None:
    """Poll ``done()`` until ``deadline``; a client that exits with an error before that fails the run."""
    while not done():
        for index, proc in enumerate(procs):
            if proc.poll() not in (None, 0):
                raise BaselineError(f"SyncReplicas client {index} failed (exit {proc.returncode}) while waiting for "
                                    f"{what}:\n{_tail_file(tmp_path / f'worker{index}.stderr')}")
        if time.monotonic() > deadline:
            raise BaselineError(f"SyncReplicas baseline: timed out waiting for {what}:\n"
                                f"{_tail_file(tmp_path / 'worker0.stderr')}")
        time.sleep(0.05)


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        kill_process_trees([(proc.pid, 0.0)], grace=10.0)  # the workbench's own: SIGTERM, then SIGKILL
        proc.wait(10)
    if proc.stdin and not proc.stdin.closed:
        with contextlib.suppress(OSError):  # a client that died leaves a broken pipe
            proc.stdin.close()


def _tail(text: str | bytes | None) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-STDERR_TAIL:]


def _tail_file(path: Path) -> str:
    return _tail(path.read_text(errors="replace")) if path.exists() else ""


# ---------------------------------------------------------------- baseline processes


def pss_main(config: dict) -> None:
    import keras
    import tensorflow as tf

    from workbench.datasets import digits_arrays

    start = time.time()
    threads.apply_to_context()  # this process's pools, and its contexts on the tasks, as the workbench's client sets them
    spec, k, per_worker_batch = config["spec"], config["steps_per_call"], config["per_worker_batch"]
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec(spec), rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    x, y = digits_arrays("train")
    keras.utils.set_random_seed(config["seed"])
    with strategy.scope():
        model = _keras_mlp(keras, config["hidden"])
        optimizer = keras.optimizers.Adam(LEARNING_RATE)
        optimizer.build(model.trainable_variables)  # slots on the ps now, not in the first traced step
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables

    def dataset_fn():
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(y), seed=config["seed"]).repeat()
        return dataset.batch(per_worker_batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        # Reads of the updated variables run on their ps after the update (automatic control dependencies)
        # and are only waited on, never sent: the step's timestamp follows its whole update.
        return tf.group(*[tf.convert_to_tensor(v) for v in [*variables, optimizer.iterations]])

    @tf.function
    def train_steps(iterator):
        stamps = tf.TensorArray(tf.float64, size=k)
        for i in tf.range(k):
            updated = strategy.run(replica_step, args=next(iterator))
            with tf.control_dependencies([updated]):
                stamps = stamps.write(i, tf.timestamp())
        return stamps.stack()

    calls = [coordinator.schedule(train_steps, args=(iterator,)) for _ in range(-(-config["steps"] // k))]
    coordinator.join()
    stamps = sorted(float(t) for call in calls for t in call.fetch())
    print("RESULT " + json.dumps({"stamps": stamps, "start": start}), flush=True)


def local_main(config: dict) -> None:
    """The limit: the same step (model, batch, optimizer, loss) as a ``tf.function`` in this one process, no cluster.

    ``steps_per_call`` steps per call in a ``tf.range`` loop (as the workbench and PSS run them), one
    ``tf.timestamp()`` after each step's update; a thread samples this process's CPU time meanwhile.
    """
    import keras
    import tensorflow as tf
    from cpu import CpuSampler

    from workbench.datasets import digits_arrays

    threads.apply_to_context()  # this process's pools, and its contexts on the tasks, as the workbench's client sets them
    k = config["steps_per_call"]
    x, y = digits_arrays("train")
    keras.utils.set_random_seed(config["seed"])
    model = _keras_mlp(keras, config["hidden"])
    optimizer = keras.optimizers.Adam(LEARNING_RATE)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(y), seed=config["seed"]).repeat()
    iterator = iter(dataset.batch(config["per_worker_batch"], drop_remainder=True).prefetch(tf.data.AUTOTUNE))

    @tf.function
    def train_steps(iterator):
        stamps = tf.TensorArray(tf.float64, size=k)
        for i in tf.range(k):
            xb, yb = next(iterator)
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
            with tf.control_dependencies([tf.convert_to_tensor(v) for v in variables]):
                stamps = stamps.write(i, tf.timestamp())
        return stamps.stack()

    stamps = []
    with CpuSampler() as sampler:
        for _ in range(-(-config["steps"] // k)):
            stamps.extend(float(t) for t in train_steps(iterator).numpy())
    print("RESULT " + json.dumps({"stamps": stamps, "cpu": sampler.samples}), flush=True)


def _keras_mlp(keras, hidden: int):
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(hidden, activation="relu"),
                             keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(10)])


def sync_replicas_main(config: dict) -> None:
    import tensorflow as tf

    from workbench.datasets import digits_arrays

    if config["index"] == 0:
        Path(config["points"] + ".start").write_text(f"{time.time():.6f}")
    v1 = tf.compat.v1
    v1.disable_eager_execution()  # Keras 3 layers do not build in TF1 graphs: the MLP is written out below
    train_op, step_after, hooks, _ = sync_replicas_graph(
        tf, config, digits_arrays("train"), lambda inputs: _graph_mlp(v1, tf, inputs, config["hidden"]), LEARNING_RATE)
    hooks.append(v1.train.StopAtStepHook(last_step=config["steps"]))
    with open(config["points"], "w", buffering=1) as points:  # line by line: non-chiefs end terminated
        sess = tf1_session(v1, config, hooks)
        while not sess.should_stop():
            _, step = sess.run([train_op, step_after])
            points.write(f"{time.time():.6f} {step}\n")
    sess.close()


def sync_replicas_graph(tf, config: dict, data: tuple, model, learning_rate: float):
    """Client ``config["index"]``'s TF1 graph: its shard of ``data`` on its worker, ``model(inputs) -> logits`` with
    its variables on the ps (``replica_device_setter``), Adam under ``SyncReplicasOptimizer`` (N - k of N).
    Returns ``(train_op, global step after this step, [the optimizer's session hook], the model's variables)``."""
    v1 = tf.compat.v1
    spec, index = config["spec"], config["index"]
    workers = len(spec["worker"])
    worker_device = f"/job:worker/task:{index}"
    x, y = data
    v1.set_random_seed(config["seed"])
    setter = v1.train.replica_device_setter(cluster=tf.train.ClusterSpec(spec), worker_device=worker_device)
    with v1.container(config["container"]), v1.device(setter):
        global_step = v1.train.get_or_create_global_step()
        with v1.device(worker_device):
            dataset = tf.data.Dataset.from_tensor_slices((x, y)).shard(workers, index)
            dataset = dataset.shuffle(len(y), seed=config["seed"]).repeat()
            dataset = dataset.batch(config["per_worker_batch"], drop_remainder=True).prefetch(2)
            xb, yb = v1.data.make_one_shot_iterator(dataset).get_next()
        logits = model(xb)
        variables = v1.trainable_variables()
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=logits))
        optimizer = v1.train.SyncReplicasOptimizer(v1.train.AdamOptimizer(learning_rate),
                                                   replicas_to_aggregate=workers - config["backup_workers"],
                                                   total_num_replicas=workers)
        train_op = optimizer.minimize(loss, global_step=global_step)
        with tf.control_dependencies([train_op]):
            step_after = tf.identity(global_step.read_value())  # read once this worker's step is through
    return train_op, step_after, [optimizer.make_session_run_hook(index == 0)], variables


def tf1_session(v1, config: dict, hooks: list):
    """The ``MonitoredTrainingSession`` of SyncReplicas client ``config["index"]`` on its worker's master; a non-chief
    waits until the bench says the chief's session exists (``run_chief_first``), the chief says so."""
    spec, index = config["spec"], config["index"]
    session_config = threads.apply(v1.ConfigProto(device_filters=["/job:ps", f"/job:worker/task:{index}"]))
    if index != 0:
        sys.stdin.readline()
    sess = v1.train.MonitoredTrainingSession(
        master="grpc://" + spec["worker"][index], is_chief=index == 0, hooks=hooks, config=session_config,
        log_step_count_steps=0, stop_grace_period_secs=2)
    if index == 0:
        Path(config["ready"]).touch()
    return sess


def _graph_mlp(v1, tf, inputs, hidden: int):
    """64-hidden-hidden-10 with relu, glorot-uniform weights and zero biases, as Keras' Dense builds it."""
    out = inputs
    for layer, (fan_in, fan_out) in enumerate([(64, hidden), (hidden, hidden), (hidden, 10)]):
        kernel = v1.get_variable(f"dense{layer}/kernel", [fan_in, fan_out], initializer=v1.glorot_uniform_initializer())
        bias = v1.get_variable(f"dense{layer}/bias", [fan_out], initializer=v1.zeros_initializer())
        out = tf.matmul(out, kernel) + bias
        if layer < 2:
            out = tf.nn.relu(out)
    return out


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    {"pss": pss_main, "sync-replicas": sync_replicas_main, "local": local_main}[sys.argv[1]](json.loads(sys.argv[2]))
