"""Training throughput: the workbench's async-ps loop against a hand-written TF loop, same cluster, one run.

Baseline: a straightforward ``ParameterServerStrategy`` + ``ClusterCoordinator`` custom loop (one
step per scheduled closure, per-worker datasets), run in a separate process (one process must not
mix TF cluster connections), against the *same* running cluster. Both train the same Keras MLP on
the same digits data with the same global batch. Runs alternate, and the figures are medians, so
both see the same machine load. Goal: workbench / baseline >= 1.0 in steps/s.

Also reported: sync-ps (backup_workers 0 and 1) and allreduce throughput, and the loopback bytes per step
(``/proc/net/dev``; this includes a little control traffic, and on one machine all ps<->worker
traffic crosses loopback).

    python bench/training.py [--repeats 3] [--steps 600]

``--containment`` measures instead what keeping TensorFlow's ports on their ClusterSpec address costs:
fresh 1 ps + 2 worker clusters, alternating between the default (the bind shim binds 127.0.0.1) and
``WORKBENCH_BIND_ADDRESS="*"`` (every interface, TensorFlow's own behaviour), async-ps and all-reduce on
each; medians and ratios. Goal: no cost beyond noise.

    python bench/training.py --containment [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HIDDEN = 256

BASELINE = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import tensorflow as tf, keras
    from workbench.datasets import digits_arrays
    spec, steps, batch, hidden = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec(spec), rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    x, y = digits_arrays("train")
    per_worker = batch // len(spec["worker"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(hidden, activation="relu"),
                                  keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(10)])
        optimizer = keras.optimizers.Adam(0.001)
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    def dataset_fn():
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(y), seed=0).repeat()
        return dataset.batch(per_worker, drop_remainder=True).prefetch(2)
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    @tf.function
    def step(it):
        def replica(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        xb, yb = next(it)
        return strategy.run(replica, args=(xb, yb))
    for _ in range(20):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    start = time.perf_counter()
    for _ in range(steps):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    print("RESULT " + json.dumps({"seconds": time.perf_counter() - start}))
""")


def loopback_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        if line.strip().startswith("lo:"):
            return int(line.split(":", 1)[1].split()[0])
    return 0


def baseline_run(spec: dict, steps: int, batch: int) -> float:
    proc = subprocess.run([sys.executable, "-c", BASELINE, json.dumps(spec), str(steps), str(batch), str(HIDDEN)],
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"baseline failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][7:])["seconds"]


def workbench_run(cluster, steps: int, batch: int, **kwargs) -> tuple[float, float]:
    import keras

    import workbench as wb

    def make_model():
        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(HIDDEN, activation="relu"),
                                 keras.layers.Dense(HIDDEN, activation="relu"), keras.layers.Dense(10)])

    def run(n):
        return wb.train(cluster, make_model, wb.datasets.digits, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        keras.optimizers.Adam(0.001), steps=n, batch_size=batch, seed=0, **kwargs).wait(900)

    run(20)  # trace and warm up, as the baseline does
    before, start = loopback_bytes(), time.perf_counter()
    run(steps)
    seconds = time.perf_counter() - start
    return seconds, (loopback_bytes() - before) / steps


def _tensorflow_addresses(cluster) -> set[str]:
    from workbench.cluster import containment

    return {ip for record in cluster.tasks for ip, _ in containment.listeners(record.pid)}


def containment_main(args: argparse.Namespace) -> int:
    """Contained ports against every interface, alternating fresh clusters (see the module docstring)."""
    import workbench as wb
    from workbench.cluster.containment import BIND_ENV, EVERY_INTERFACE

    modes = {"contained": {}, "every interface": {BIND_ENV: EVERY_INTERFACE}}
    rates: dict[str, dict[str, list[float]]] = {mode: {"async-ps": [], "allreduce": []} for mode in modes}
    for i in range(args.repeats):
        for mode, env in modes.items():
            with wb.Cluster(ps=1, workers=2, progress=False, env=env) as cluster:
                addresses = _tensorflow_addresses(cluster)
                wide = bool(addresses & {"::", "0.0.0.0"})
                if wide != (mode == "every interface"):
                    raise RuntimeError(f"{mode}: the tasks listen on {sorted(addresses)}, not what this mode means")
                for strategy in ("async-ps", "allreduce"):
                    seconds, _ = workbench_run(cluster, args.steps, args.batch, strategy=strategy)
                    rates[mode][strategy].append(args.steps / seconds)
            print(f"run {i + 1}/{args.repeats} {mode:15s}: async-ps {rates[mode]['async-ps'][-1]:6.1f} steps/s, "
                  f"allreduce {rates[mode]['allreduce'][-1]:6.1f} steps/s (listening on {sorted(addresses)})", flush=True)
    medians = {mode: {k: statistics.median(v) for k, v in by.items()} for mode, by in rates.items()}
    for strategy in ("async-ps", "allreduce"):
        contained, wide = medians["contained"][strategy], medians["every interface"][strategy]
        print(f"{strategy:10s} contained {contained:6.1f} steps/s, every interface {wide:6.1f}: ratio {contained / wide:.2f}")
    path = args.json.with_name("containment.json") if args.json.name == "training.json" else args.json
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"medians": medians, "raw": rates}, indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--containment", action="store_true", help="contained ports against every interface")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "training.json")
    args = parser.parse_args()
    if args.containment:
        return containment_main(args)

    import workbench as wb

    results: dict[str, list] = {"baseline": [], "async": [], "async_bytes": [], "sync0": [], "sync1": [], "sync_bytes": [],
                                "allreduce": [], "allreduce_bytes": []}
    with wb.Cluster(ps=1, workers=2, progress=False) as cluster:
        spec = cluster.spec_dict
        for i in range(args.repeats):
            results["baseline"].append(args.steps / baseline_run(spec, args.steps, args.batch))
            seconds, per_step = workbench_run(cluster, args.steps, args.batch, strategy="async-ps")
            results["async"].append(args.steps / seconds)
            results["async_bytes"].append(per_step)
            seconds, per_step = workbench_run(cluster, args.steps // 3, args.batch, strategy="sync-ps")
            results["sync0"].append(args.steps // 3 / seconds)
            results["sync_bytes"].append(per_step)
            seconds, _ = workbench_run(cluster, args.steps // 3, args.batch, strategy="sync-ps", backup_workers=1)
            results["sync1"].append(args.steps // 3 / seconds)
            seconds, per_step = workbench_run(cluster, args.steps, args.batch, strategy="allreduce")
            results["allreduce"].append(args.steps / seconds)
            results["allreduce_bytes"].append(per_step)
            print(f"run {i + 1}/{args.repeats}: baseline {results['baseline'][-1]:.1f} steps/s, workbench async-ps "
                  f"{results['async'][-1]:.1f}, sync-ps {results['sync0'][-1]:.1f} (k=1: {results['sync1'][-1]:.1f}), "
                  f"allreduce {results['allreduce'][-1]:.1f}", flush=True)
    median = {k: statistics.median(v) for k, v in results.items()}
    summary = {
        "model": f"MLP 64-{HIDDEN}-{HIDDEN}-10 (~{(64 * HIDDEN + HIDDEN * HIDDEN + HIDDEN * 10) * 4 / 1e3:.0f} kB of weights)",
        "global_batch": args.batch,
        "baseline_steps_per_s": median["baseline"],
        "workbench_async_steps_per_s": median["async"],
        "ratio": median["async"] / median["baseline"],
        "goal_ratio": 1.0,
        # async steps (and the baseline's) each take one worker's half of the global batch; a sync-ps step
        # the whole batch (k=1 with 2 workers: one half); an allreduce step the whole batch
        "examples_per_s": {"baseline": median["baseline"] * args.batch / 2, "async": median["async"] * args.batch / 2,
                           "sync-ps": median["sync0"] * args.batch, "sync-ps k=1": median["sync1"] * args.batch / 2,
                           "allreduce": median["allreduce"] * args.batch},
        "sync_ps_steps_per_s": median["sync0"],
        "sync_ps_backup1_steps_per_s": median["sync1"],
        "allreduce_steps_per_s": median["allreduce"],
        "loopback_bytes_per_step": {"async-ps": median["async_bytes"], "sync-ps": median["sync_bytes"],
                                    "allreduce": median["allreduce_bytes"]},
        "raw": results,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "raw"}, indent=2))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
