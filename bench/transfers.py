"""What a transfer between two tasks costs: a model's variables one by one, against the same bytes packed.

A loop of steps runs on a worker of a fresh 1 ps + 1 worker cluster. Each step reads the
bench MLP's six variables (64-256-256-10, 336 kB) from the ps, computes a stand-in gradient on
the worker and adds it back on the ps:

* ``alone``: each variable read and written as its own tensor (what TensorFlow does by itself);
* ``packed``: the ps concatenates the six, the worker splits them, and the gradients travel back
  as one tensor, split on the ps (what the workbench's ps strategies do, ``training/strategies/ps/packing.py``);
* ``tiny``: one 16-float variable, the cost of a step's loop and a transfer each way with no bytes.

Reports wall ms and CPU ms per step of the ps and the worker, medians over alternating repeats:

    python bench/transfers.py [--steps 1000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from cpu import cpu_seconds
from training import HIDDEN, TIMEOUT

SHAPES = [(64, HIDDEN), (HIDDEN,), (HIDDEN, HIDDEN), (HIDDEN,), (HIDDEN, 10), (10,)]


def loop(body):
    import tensorflow as tf

    @tf.function
    def steps(n):
        for _ in tf.range(n):
            tf.autograph.experimental.set_loop_options(parallel_iterations=1)
            body()
        return tf.timestamp()

    return steps


def bodies(ps: str, worker: str) -> dict:
    """The three step bodies, over variables made on ``ps``."""
    import tensorflow as tf

    with tf.device(ps):
        variables = [tf.Variable(tf.zeros(shape)) for shape in SHAPES]
        tiny = tf.Variable(tf.zeros([16]))
    sizes = [int(v.shape.num_elements()) for v in variables]

    def gradient(value):
        return value * 1e-9 + 1e-9

    def alone():
        values = [v.read_value() for v in variables]
        with tf.device(worker):
            grads = [gradient(value) for value in values]
        for variable, grad in zip(variables, grads):
            variable.assign_add(grad)

    def packed():
        with tf.device(ps):
            flat = tf.concat([tf.reshape(v.read_value(), [-1]) for v in variables], 0)
        with tf.device(worker):
            grads = [gradient(tf.reshape(part, v.shape)) for part, v in zip(tf.split(flat, sizes), variables)]
            back = tf.concat([tf.reshape(g, [-1]) for g in grads], 0)
        with tf.device(ps):
            for variable, part in zip(variables, tf.split(back, sizes)):
                variable.assign_add(tf.reshape(part, variable.shape))

    def empty():
        value = tiny.read_value()
        with tf.device(worker):
            grad = gradient(value)
        tiny.assign_add(grad)

    return {"alone": loop(alone), "packed": loop(packed), "tiny": loop(empty)}


def bounded(call, device: str, what: str) -> None:
    """Run ``call()`` on ``device`` for at most ``TIMEOUT`` s; a task that stopped answering ends the bench."""
    import tensorflow as tf

    failed: list[BaseException] = []

    def run() -> None:
        try:
            with tf.device(device):
                call()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(TIMEOUT)
    if thread.is_alive():
        raise SystemExit(f"{what} did not finish within {TIMEOUT:.0f} s: a task stopped answering (the cluster is stopped)")
    if failed:
        raise failed[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import tensorflow as tf

    import workbench as wb
    from workbench.cluster.process import connection

    with wb.Cluster(ps=1, workers=1, progress=False) as cluster:
        connection.connect(cluster)
        ps, worker = (f"{r.task.device}/device:CPU:0" for r in cluster.tasks)
        lines = bodies(ps, worker)
        pids = {r.job: r.pid for r in cluster.tasks}
        results: dict[str, list[dict]] = {name: [] for name in lines}
        for name, steps in lines.items():  # traced and registered on the tasks before anything is timed
            bounded(lambda steps=steps: steps(tf.constant(5)).numpy(), worker, f"{name}'s first call")
        for repeat in range(args.repeats):
            for name, steps in (lines.items() if repeat % 2 == 0 else reversed(lines.items())):
                before = {job: cpu_seconds(pid) for job, pid in pids.items()}
                started = time.perf_counter()
                bounded(lambda steps=steps: steps(tf.constant(args.steps)).numpy(), worker, f"{name}'s run")
                wall = time.perf_counter() - started
                cpu = {job: (cpu_seconds(pid) - before[job]) * 1e3 / args.steps for job, pid in pids.items()}
                results[name].append({"wall_ms": wall * 1e3 / args.steps, **{f"{job}_cpu_ms": ms for job, ms in cpu.items()}})
                print(f"repeat {repeat + 1}/{args.repeats} {name}: {results[name][-1]}", flush=True)
    print(f"\nmedians of {args.repeats}, per step ({args.steps} steps a run):")
    print(f"{'line':8s} {'wall ms':>8s} {'ps CPU ms':>10s} {'worker CPU ms':>14s}")
    medians = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in results.items()}
    for name, m in medians.items():
        print(f"{name:8s} {m['wall_ms']:8.3f} {m['ps_cpu_ms']:10.3f} {m['worker_cpu_ms']:14.3f}")
    cpu = {name: m["ps_cpu_ms"] + m["worker_cpu_ms"] for name, m in medians.items()}
    print(f"CPU per step, packed / alone: {cpu['packed'] / cpu['alone']:.2f}")
    out = Path(__file__).parent / "results" / "transfers.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": args.steps, "repeats": args.repeats, "medians": medians, "raw": results}, indent=2))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
