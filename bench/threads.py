"""How many threads a task computes on: each task's share of the machine's cores against TensorFlow's default.

The workbench gives each TF server's intra-op pool its share of the machine's cores (``workbench.cluster.machine.
threads``: a worker ``cores // workers there``, a ps ``cores // tasks there``); TensorFlow's default is every core
in every task. This bench trains 2-worker jobs (async-ps and all-reduce, ``steps_per_call`` 10, a global batch of
64) on a ``wb.Cluster(ps=1, workers=2)`` started each way, alternating (the order reversed every other pair): the
share, and TensorFlow's default asked for explicitly (``TF_NUM_INTRAOP_THREADS`` = this machine's cores in the
engines' environment, which the workbench then leaves alone). Each cluster trains every job once unmeasured,
then once measured: steps/s from the job's own step records after ``--warmup`` steps. Workloads: the digits
MLP and the time-to-accuracy CNN (``tta_workloads``) at ``--widths``. It also times one large matmul on a
worker (CPU seconds of its process over wall seconds: the threads one op actually used).

    python bench/threads.py [--pairs 2] [--widths 1,4] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from cpu import cpu_seconds
from tta_workloads import DATA, model_fn

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
TIMEOUT = 600.0  # seconds any one job may take
SIDES = ("async-ps", "allreduce")


def pools() -> dict[str, dict[str, str]]:
    """The two ways of sizing the pools: the engines' environment of each."""
    return {"tensorflow": {"TF_NUM_INTRAOP_THREADS": str(len(os.sched_getaffinity(0)))}, "share": {}}


def op_parallelism(cluster, size: int = 1500, repeats: int = 10) -> float:
    """CPU seconds over wall seconds of worker:0's process while it multiplies two ``size``-square matrices."""
    import tensorflow as tf

    cluster.connect()
    pid = next(r.pid for r in cluster.tasks if r.name == "worker:0")
    with tf.device("/job:worker/replica:0/task:0/device:CPU:0"):
        a, b = tf.random.normal([size, size]), tf.random.normal([size, size])
        float(tf.reduce_sum(tf.linalg.matmul(a, b)))  # placed and warm
        cpu, wall = cpu_seconds(pid), time.perf_counter()
        for _ in range(repeats):
            product = tf.linalg.matmul(a, b)
        float(tf.reduce_sum(product))
        return (cpu_seconds(pid) - cpu) / (time.perf_counter() - wall)


def steps_per_s(cluster, side: str, workload: str, width: float, steps: int, warmup: int) -> float:
    import keras

    import workbench as wb

    strategy = wb.AsyncPS(steps_per_call=10) if side == "async-ps" else wb.AllReduce(steps_per_call=10)
    job = wb.train(cluster, model_fn(workload, width), DATA[workload],
                   keras.losses.SparseCategoricalCrossentropy(from_logits=True), "adam", strategy=strategy,
                   steps=steps, batch_size=64, seed=0).wait(TIMEOUT)
    return job.throughput(warmup=warmup)["steps_per_s"]


def measure(name: str, env: dict, workloads: list[tuple[str, float]], steps: int, warmup: int) -> dict:
    import workbench as wb

    result = {}
    with wb.Cluster(ps=1, workers=2, name=f"wb-bench-threads-{name}", env=env, progress=False) as cluster:
        result["op_parallelism"] = op_parallelism(cluster)
        for workload, width in workloads:
            for side in SIDES:
                steps_per_s(cluster, side, workload, width, steps, warmup)  # unmeasured: traced, connected
                result[f"{workload}-{width:g} {side}"] = steps_per_s(cluster, side, workload, width, steps, warmup)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--widths", default="1,4", help="the CNN's widths (filters x width)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results" / "threads.json")
    args = parser.parse_args()
    workloads = [("mlp", 1.0), *(("cnn", float(w)) for w in args.widths.split(","))]
    runs: dict[str, list[dict]] = {name: [] for name in pools()}
    for pair in range(args.pairs):
        order = list(pools().items())
        for name, env in order if pair % 2 == 0 else order[::-1]:
            runs[name].append(measure(name, env, workloads, args.steps, args.warmup))
            print(name, {k: round(v, 2) for k, v in runs[name][-1].items()}, flush=True)
    keys = list(runs["share"][0])
    print(f"\n{'':24s} {'TensorFlow default':>20s} {'share':>10s} {'share / default':>16s}")
    summary = {}
    for key in keys:
        default, share = (statistics.median(r[key] for r in runs[name]) for name in ("tensorflow", "share"))
        summary[key] = {"tensorflow": default, "share": share, "ratio": share / default}
        print(f"{key:24s} {default:20.2f} {share:10.2f} {share / default:16.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"cores": len(os.sched_getaffinity(0)), "runs": runs, "medians": summary}, indent=1))


if __name__ == "__main__":
    main()
