"""Training throughput: the workbench's loops against strong hand-written TensorFlow, one cluster, steady state.

On one ``wb.Cluster(ps=1, workers=N)`` (``--workers``, default 3), every line trains the same model
(MLP 64-256-256-10, relu), on the same data (digits, ``workbench.datasets.digits_arrays("train")``),
with the same per-worker batch (``--per-worker-batch``, 32: a global batch of 32 N), Adam(0.001)
and sparse cross-entropy from logits:

- workbench ``async-ps`` (``steps_per_call`` K, ``--steps-per-call``, default 10), against
  ``ParameterServerStrategy`` + ``ClusterCoordinator`` with K steps per scheduled function (a
  ``tf.range`` loop, per-worker datasets) — goal: workbench / baseline >= 1.3 in steps/s; and, as a
  secondary line, against the same baseline with one step per closure;
- workbench ``sync-ps`` with ``backup_workers`` k = 0 and 1, against TF1 between-graph
  ``SyncReplicasOptimizer`` (``replicas_to_aggregate`` N - k, ``MonitoredTrainingSession`` clients,
  one per worker) — goal: >= 1.5 for each k on the steady-state estimator, >= 1.2 on the short-run one;
- workbench ``allreduce`` (no baseline);
- ``local``, the limit: the same step (model, per-worker batch, optimizer, loss) as a ``tf.function`` with K
  steps per call in one process, no cluster. The **distribution overhead** of a workbench line is its CPU
  per example in the steady state (ps tasks + worker tasks + the kernel, sampled every 50 ms from
  ``/proc``) over the local process's CPU per example in its steady state: ``sum(steady CPU ms per step) /
  examples per step`` / ``(local CPU ms per step / per-worker batch)``. A dropped backup gradient's CPU
  counts as overhead. Goals: <= 1.5 for async-ps, <= 2.0 for sync-ps.

The baselines run in processes of their own (``bench/training_baselines.py``: one process must not mix
TensorFlow cluster connections) against the same running cluster's ``spec_dict``.

Every line is measured by two estimators. The **steady-state** one: from each run, points (time, steps
finished by then) — the workbench: its ``job.history`` step end times (workers' clocks); PSS: a
worker-side ``tf.timestamp()`` after each step's update; TF1: each client's ``(time.time(), global
step)`` after each ``session.run`` — and the rate over the window from the first point at >= 20% of the
run's steps to the last point at <= 90% of them, so start-up, tracing and the tail fall outside it on
every side. The **short-run host-clock** one (``wall``), as a user feels a short run (300 steps by
default for sync): every step of the run over the host time from when it was asked for to its end — the
workbench: ``wb.train`` called to ``job.wait()`` returned, in the kernel (building the model on the ps,
tracing, the first calls included); PSS and TF1: from the (chief) client's start after its ``import
tensorflow`` (graph building, session creation included) to its last step. All processes are on this
machine: one clock.
A step is one optimizer update: one worker's batch in async-ps and PSS, N - k batches in sync-ps and
SyncReplicas, N batches in allreduce (examples/s says so). Bytes per step: loopback bytes received
(``/proc/net/dev``) over each whole run (start-up included, both sides; on one machine all ps <-> worker
traffic crosses loopback, and so does anything else on this machine's loopback meanwhile) / steps.
CPU ms per step: CPU time of the ps tasks, of the worker tasks and of the client over each whole run /
steps (the client is the kernel for the workbench, the baseline's own processes otherwise, start-up
included).

Within each repeat the runs alternate, baseline then workbench (the order reversed every other repeat);
the figures are medians over repeats (``--repeats``, default 3), and the ratios are ratios of medians;
the raw per-repeat values go to ``--json`` (``bench/results/training.json``). A line that fails is
reported and left out; the script then exits 1.

    python bench/training.py [--repeats 3] [--steps 600] [--sync-steps 300] [--workers 3] [--lines pss-k,async-ps]

``--containment`` measures instead what keeping TensorFlow's ports on their ClusterSpec address costs:
fresh 1 ps + 2 worker clusters, alternating between the default (the bind shim binds 127.0.0.1) and
``WORKBENCH_BIND_ADDRESS="*"`` (every interface, TensorFlow's own behaviour), async-ps and all-reduce on
each, with the same estimator; medians and ratios. Goal: no cost beyond noise.

    python bench/training.py --containment [--repeats 5]

``--callbacks`` measures what Keras callbacks cost an async-ps job (``--workers``, ``--steps``): the same job
without callbacks, with 6 epochs (``steps_per_epoch`` = steps / 6) and no callbacks, and with 6 epochs, Keras's
``TensorBoard`` callback (its runs and the per-worker ones) and a custom callback (batch losses, the
learning rate at each epoch's end), alternating, medians and ratios. Goal: >= 0.95 with callbacks.

    python bench/training.py --callbacks [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from cpu import CpuSampler, between, cpu_seconds, own_cpu_seconds
from training_baselines import LEARNING_RATE, run_local, run_pss, run_sync_replicas

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HIDDEN = 256
WINDOW = (0.2, 0.9)  # the steady-state window, as fractions of a run's steps
TIMEOUT = 900.0  # seconds any one run (a workbench job, a baseline's processes) may take
SEED = 0

Points = list[tuple[float, int]]


def steady_window(points: Points) -> tuple[tuple[float, int], tuple[float, int]]:
    """The first point at >= 20% of the steps and the last at <= 90%: the steady state's ends.

    ``points`` are ``(time, steps finished by then)``, in any order; the run's steps are the largest count.
    """
    points = sorted(points)
    total = max(count for _, count in points)
    first = next((p for p in points if p[1] >= WINDOW[0] * total), None)
    last = next((p for p in reversed(points) if p[1] <= WINDOW[1] * total), None)
    if first is None or last is None or last[0] <= first[0] or last[1] <= first[1]:
        raise ValueError(f"no steady-state window in {len(points)} points ({total} steps): run more steps")
    return first, last


def steady_rate(points: Points) -> float:
    """Steps per second over the steady-state window (``steady_window``)."""
    first, last = steady_window(points)
    return (last[1] - first[1]) / (last[0] - first[0])


def completion_points(history: list[dict]) -> Points:
    """A job's history -> ``(time, steps finished by then)``, on the workers' clocks (for ``steady_rate``)."""
    ends = sorted(record["end"] for record in history)
    return list(zip(ends, range(1, len(ends) + 1)))


def finished(job):
    """``job`` once it ended; one still running after ``TIMEOUT`` is stopped, then the TimeoutError raised."""
    try:
        return job.wait(TIMEOUT)
    except TimeoutError:
        job.stop()
        raise


def loopback_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        if line.strip().startswith("lo:"):
            return int(line.split(":", 1)[1].split()[0])
    return 0


@dataclass(frozen=True)
class Timing:
    """What one run hands back: its points, the examples of a step, and when it was asked for and seen to end
    (host clock: the workbench's ``wb.train`` call and ``job.wait`` return; a baseline client's start after its
    ``import tensorflow`` and its last step)."""

    points: Points
    examples_per_step: float
    asked: float
    ended: float


@dataclass(frozen=True)
class Run:
    steps_per_s: float  # the steady-state estimator
    wall_steps_per_s: float  # the short-run estimator: every step over the host time from asked to ended
    examples_per_s: float
    bytes_per_step: float
    steps: int
    cpu_ms_per_step: dict[str, float]  # ps tasks, worker tasks, client (this process and its children), whole run
    steady_cpu_ms_per_step: dict[str, float]  # the same in the steady-state window (client: this process alone)


def measured(run: Callable[[], Timing], steps: int, cluster, client_here: bool = False) -> Run:
    """Run ``run()``, counting the loopback bytes and the CPU time around it and in its steady state.

    On a 2-core machine every line is CPU-bound, so CPU time per step says where a rate goes: the
    ps and worker tasks are the same processes for every line; the client is this process (the
    workbench's kernel) plus the baselines' own processes (their start-up included). In the steady
    state the client is this process, counted only where it is the client (``client_here``: the
    workbench's lines; the baselines' clients are not sampled).
    """
    roles = {role: [r.pid for r in cluster.tasks if r.job == role] for role in ("ps", "worker")}
    before_cpu = {role: sum(cpu_seconds(p) for p in pids) for role, pids in roles.items()}
    before_client, before = own_cpu_seconds(children=True), loopback_bytes()
    with CpuSampler(roles) as sampler:
        timing = run()
    first, last = steady_window(timing.points)
    rate = (last[1] - first[1]) / (last[0] - first[0])
    cpu = {role: (sum(cpu_seconds(p) for p in pids) - before_cpu[role]) * 1e3 / steps for role, pids in roles.items()}
    cpu["client"] = (own_cpu_seconds(children=True) - before_client) * 1e3 / steps
    steady = {role: s * 1e3 / (last[1] - first[1]) for role, s in sampler.between(first[0], last[0]).items()
              if client_here or role != "client"}
    wall = max(count for _, count in timing.points) / (timing.ended - timing.asked)
    return Run(rate, wall, rate * timing.examples_per_step, (loopback_bytes() - before) / steps, steps, cpu, steady)


def make_model():
    import keras

    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(HIDDEN, activation="relu"),
                             keras.layers.Dense(HIDDEN, activation="relu"), keras.layers.Dense(10)])


def workbench_run(cluster, *, strategy: str, steps: int, batch: int, steps_per_call: int, backup_workers: int = 0,
                  packed: bool = True, overlap: bool = False, fit: Callable[[], dict] | None = None) -> Run:
    """``packed=False``: every tensor travels alone between tasks (``WORKBENCH_PACKED_TRANSFERS=0``); ``fit()``:
    more ``wb.train`` arguments (epochs, callbacks), made afresh for each run."""
    import keras

    import workbench as wb

    def run() -> Timing:
        os.environ["WORKBENCH_PACKED_TRANSFERS"] = "1" if packed else "0"  # read when the job starts
        extra = fit() if fit else {}
        asked = time.time()
        job = wb.train(cluster, make_model, wb.datasets.digits, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                       keras.optimizers.Adam(LEARNING_RATE), steps=None if "epochs" in extra else steps, batch_size=batch,
                       seed=SEED, strategy=_strategy(strategy, backup_workers, steps_per_call, overlap), **extra)
        history = finished(job).history
        return Timing(completion_points(history), sum(r["examples"] for r in history) / len(history), asked, time.time())

    return measured(run, steps, cluster, client_here=True)


def _strategy(name: str, backup_workers: int, steps_per_call: int, overlap: bool = False):
    from workbench.training import strategy_named

    options = {"backup_workers": backup_workers} if backup_workers else {}
    if overlap:
        options["overlap"] = True
    return strategy_named(name, steps_per_call=steps_per_call, **options)


def pss_run(cluster, *, steps: int, steps_per_call: int, per_worker_batch: int) -> Run:
    def run() -> Timing:
        stamps, asked = run_pss(cluster.spec_dict, steps=steps, steps_per_call=steps_per_call,
                                per_worker_batch=per_worker_batch, hidden=HIDDEN, seed=SEED, timeout=TIMEOUT)
        return Timing(list(zip(sorted(stamps), range(1, len(stamps) + 1))), per_worker_batch, asked, max(stamps))

    return measured(run, steps, cluster)


def sync_replicas_run(cluster, *, steps: int, backup_workers: int, per_worker_batch: int) -> Run:
    def run() -> Timing:
        points, asked = run_sync_replicas(cluster.spec_dict, steps=steps, backup_workers=backup_workers,
                                          per_worker_batch=per_worker_batch, hidden=HIDDEN, seed=SEED, timeout=TIMEOUT)
        examples = (len(cluster.spec_dict["worker"]) - backup_workers) * per_worker_batch
        return Timing(points, examples, asked, max(t for t, _ in points))

    return measured(run, steps, cluster)


def local_run(*, steps: int, steps_per_call: int, per_worker_batch: int) -> Run:
    """The limit: the same step in one process (``training_baselines.local_main``), its own CPU time sampled there."""
    result = run_local(steps=steps, steps_per_call=steps_per_call, per_worker_batch=per_worker_batch, hidden=HIDDEN,
                       seed=SEED, timeout=TIMEOUT)
    points = list(zip(sorted(result["stamps"]), range(1, len(result["stamps"]) + 1)))
    first, last = steady_window(points)
    samples = result["cpu"]
    cpu = between(samples, first[0], last[0])["client"] * 1e3 / (last[1] - first[1])
    rate = (last[1] - first[1]) / (last[0] - first[0])
    return Run(rate, rate, rate * per_worker_batch, 0.0, steps, {"client": samples[-1][1]["client"] * 1e3 / steps},
               {"client": cpu})


@dataclass(frozen=True)
class Line:
    name: str
    label: str
    run: Callable[[], Run]


@dataclass(frozen=True)
class Comparison:
    workbench: str
    baseline: str
    goal: float | None  # on the steady-state estimator
    wall_goal: float | None = None  # on the short-run estimator


# The distribution overhead's goal per workbench line: CPU of all tasks and the client per example in the steady
# state, over the local process's (``overhead``)
OVERHEAD_GOALS = {"async-ps": 1.5, "sync-ps-k0": 2.0, "sync-ps-k1": 2.0, "allreduce": None, "async-ps-unpacked": None,
                  "async-ps-overlap": None}


def lines(cluster, args: argparse.Namespace) -> list[Line]:
    """One repeat's runs, in order: each baseline next to the workbench line it is compared with."""
    spec, k, b = cluster.spec_dict, args.steps_per_call, args.per_worker_batch
    n = len(spec["worker"])

    def workbench(strategy: str, steps: int, backup: int = 0, packed: bool = True, overlap: bool = False) -> Callable[[], Run]:
        return lambda: workbench_run(cluster, strategy=strategy, steps=steps, batch=b * n, steps_per_call=k,
                                     backup_workers=backup, packed=packed, overlap=overlap)

    return [
        Line("local", "one process, tf.function (the limit)",
             lambda: local_run(steps=args.steps * 3, steps_per_call=k, per_worker_batch=b)),
        Line("pss-k", f"PSS + ClusterCoordinator, {k} steps/closure",
             lambda: pss_run(cluster, steps=args.steps, steps_per_call=k, per_worker_batch=b)),
        Line("async-ps", f"workbench async-ps (steps_per_call {k})", workbench("async-ps", args.steps)),
        Line("async-ps-unpacked", "workbench async-ps, tensors unpacked", workbench("async-ps", args.steps, packed=False)),
        Line("async-ps-overlap", "workbench async-ps, overlapped reads", workbench("async-ps", args.steps, overlap=True)),
        Line("pss-1", "PSS + ClusterCoordinator, 1 step/closure",
             lambda: pss_run(cluster, steps=args.steps, steps_per_call=1, per_worker_batch=b)),
        Line("tf1-k0", f"TF1 SyncReplicas, aggregate {n} of {n}",
             lambda: sync_replicas_run(cluster, steps=args.sync_steps, backup_workers=0, per_worker_batch=b)),
        Line("sync-ps-k0", "workbench sync-ps, backup_workers 0", workbench("sync-ps", args.sync_steps)),
        Line("tf1-k1", f"TF1 SyncReplicas, aggregate {n - 1} of {n}",
             lambda: sync_replicas_run(cluster, steps=args.sync_steps, backup_workers=1, per_worker_batch=b)),
        Line("sync-ps-k1", "workbench sync-ps, backup_workers 1", workbench("sync-ps", args.sync_steps, backup=1)),
        Line("allreduce", "workbench allreduce", workbench("allreduce", args.steps)),
    ]


def comparisons(args: argparse.Namespace) -> dict[str, Comparison]:
    k = args.steps_per_call
    return {
        f"async-ps / PSS {k} steps/closure": Comparison("async-ps", "pss-k", 1.3),
        "async-ps / PSS 1 step/closure": Comparison("async-ps", "pss-1", None),
        "async-ps packed / unpacked": Comparison("async-ps", "async-ps-unpacked", None),
        "async-ps overlapped reads / reads after updates": Comparison("async-ps-overlap", "async-ps", None),
        "sync-ps k=0 / TF1 SyncReplicas k=0": Comparison("sync-ps-k0", "tf1-k0", 1.5, 1.2),
        "sync-ps k=1 / TF1 SyncReplicas k=1": Comparison("sync-ps-k1", "tf1-k1", 1.5, 1.2),
    }


def overhead(run: dict, local: dict, per_worker_batch: int) -> float:
    """CPU ms of every task and the client per example in the steady state, over the local process's per example.

    A step of ``run`` is ``examples_per_s / steps_per_s`` examples (N - k batches in sync-ps: a dropped backup
    gradient's CPU counts as overhead); a local step is one batch of ``per_worker_batch``.
    """
    examples = run["examples_per_s"] / run["steps_per_s"]
    own = sum(run["steady_cpu_ms_per_step"].values()) / examples
    return own / (local["steady_cpu_ms_per_step"]["client"] / per_worker_batch)


def summarize(raw: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    """Medians over the repeats that ran, and ratios of medians (with the per-repeat ratios), on both estimators."""
    medians = {}
    for name, runs in raw.items():
        done = [run for run in runs if "error" not in run]
        if done:
            medians[name] = {key: statistics.median(run[key] for run in done)
                             for key in ("steps_per_s", "wall_steps_per_s", "examples_per_s", "bytes_per_step")}
            for key in ("cpu_ms_per_step", "steady_cpu_ms_per_step"):
                medians[name][key] = {role: statistics.median(run[key][role] for run in done) for role in done[0][key]}
    ratios = {}
    for title, c in comparisons(args).items():
        if c.workbench in medians and c.baseline in medians:
            pairs = [(w, b) for w, b in zip(raw[c.workbench], raw[c.baseline]) if "error" not in w and "error" not in b]
            ratios[title] = {
                estimator: {"ratio": medians[c.workbench][key] / medians[c.baseline][key], "goal": goal,
                            "per_repeat": [w[key] / b[key] for w, b in pairs]}
                for estimator, key, goal in (("steady", "steps_per_s", c.goal), ("wall", "wall_steps_per_s", c.wall_goal))}
    overheads = {}
    if "local" in raw:
        for name, goal in OVERHEAD_GOALS.items():
            pairs = [(r, loc) for r, loc in zip(raw.get(name, []), raw["local"]) if "error" not in r and "error" not in loc]
            if pairs:
                per_repeat = [overhead(r, loc, args.per_worker_batch) for r, loc in pairs]
                overheads[name] = {"overhead": statistics.median(per_repeat), "goal": goal, "per_repeat": per_repeat}
    return {"medians": medians, "ratios": ratios, "overheads": overheads}


def print_report(summary: dict, labels: dict[str, str], raw: dict[str, list[dict]]) -> None:
    width = max(len(label) for label in labels.values())
    print(f"\n{'median over repeats':{width}s}  {'steps/s':>8s}  {'wall':>6s}  {'examples/s':>10s}  {'MB/step':>8s}  "
          f"{'CPU ms/step: ps':>15s}  {'workers':>7s}  {'client':>6s}  {'steady: all':>11s}")
    for name, label in labels.items():
        m = summary["medians"].get(name)
        errors = sum("error" in run for run in raw[name])
        note = f"  ({errors} run(s) failed)" if errors else ""
        if m is None:
            print(f"{label:{width}s}  {'failed':>8s}{note}")
        else:
            cpu = m["cpu_ms_per_step"]
            print(f"{label:{width}s}  {m['steps_per_s']:8.1f}  {m['wall_steps_per_s']:6.1f}  {m['examples_per_s']:10.0f}  "
                  f"{m['bytes_per_step'] / 1e6:8.2f}  {cpu.get('ps', 0.0):15.2f}  {cpu.get('worker', 0.0):7.2f}  "
                  f"{cpu['client']:6.2f}  {sum(m['steady_cpu_ms_per_step'].values()):11.2f}{note}")
    for estimator, what in (("steady", "steady-state steps/s"), ("wall", "short-run host-clock steps/s (start-up in)")):
        print(f"\nratios of median {what}")
        for title, by in summary["ratios"].items():
            r = by[estimator]
            goal = f"goal >= {r['goal']:.1f}, {'met' if r['ratio'] >= r['goal'] else 'NOT met'}" if r["goal"] else "secondary"
            runs = ", ".join(f"{x:.2f}" for x in r["per_repeat"])
            print(f"  {title:36s} {r['ratio']:5.2f}  ({goal}; per repeat: {runs})")
    if summary["overheads"]:
        print("\ndistribution overhead: steady-state CPU per example of every task and the client / the local process's")
        for name, o in summary["overheads"].items():
            goal = f"goal <= {o['goal']:.1f}, {'met' if o['overhead'] <= o['goal'] else 'NOT met'}" if o["goal"] else "secondary"
            runs = ", ".join(f"{x:.2f}" for x in o["per_repeat"])
            print(f"  {labels[name]:36s} {o['overhead']:5.2f}  ({goal}; per repeat: {runs})")


def training_main(args: argparse.Namespace) -> int:
    import workbench as wb

    with wb.Cluster(ps=1, workers=args.workers, progress=False) as cluster:
        order = lines(cluster, args)
        if args.lines:
            wanted = set(args.lines.split(","))
            unknown = wanted - {line.name for line in order}
            if unknown:
                raise SystemExit(f"--lines: unknown line(s) {sorted(unknown)}; choose from {[line.name for line in order]}")
            order = [line for line in order if line.name in wanted]
        raw: dict[str, list[dict]] = {line.name: [] for line in order}
        workbench_run(cluster, strategy="async-ps", steps=2 * args.steps_per_call * args.workers,
                      batch=args.per_worker_batch * args.workers, steps_per_call=args.steps_per_call)  # warm the cluster
        for repeat in range(args.repeats):
            for line in order if repeat % 2 == 0 else order[::-1]:
                try:
                    run = asdict(line.run())
                    cpu = ", ".join(f"{role} {ms:.2f}" for role, ms in run["cpu_ms_per_step"].items())
                    print(f"repeat {repeat + 1}/{args.repeats} {line.label}: {run['steps_per_s']:.1f} steps/s "
                          f"(wall {run['wall_steps_per_s']:.1f}), "
                          f"{run['examples_per_s']:.0f} examples/s, {run['bytes_per_step'] / 1e6:.2f} MB/step, "
                          f"CPU ms/step {cpu}", flush=True)
                except Exception as exc:  # noqa: BLE001 - one failed line is reported; the others still run
                    run = {"error": f"{type(exc).__name__}: {exc}"}
                    print(f"repeat {repeat + 1}/{args.repeats} {line.label}: FAILED {run['error'][:2000]}", flush=True)
                raw[line.name].append(run)
        gc.collect()  # the jobs' remote resources are freed now, while their tasks still run, not at exit
    summary = summarize(raw, args)
    labels = {line.name: line.label for line in order}
    print_report(summary, labels, raw)
    failed = sorted(name for name, runs in raw.items() if any("error" in run for run in runs))
    result = {
        "model": f"MLP 64-{HIDDEN}-{HIDDEN}-10 (~{(64 * HIDDEN + HIDDEN * HIDDEN + HIDDEN * 10) * 4 / 1e3:.0f} kB of weights)",
        "cluster": {"ps": 1, "workers": args.workers},
        "per_worker_batch": args.per_worker_batch, "global_batch": args.per_worker_batch * args.workers,
        "steps_per_call": args.steps_per_call, "steps": args.steps, "sync_steps": args.sync_steps, "repeats": args.repeats,
        "estimator": f"steady-state rate between {WINDOW[0]:.0%} and {WINDOW[1]:.0%} of each run's steps",
        "lines": labels, **summary, "failed": failed, "raw": raw,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"\nwritten: {args.json}")
    return 1 if failed else 0


def _tensorflow_addresses(cluster) -> set[str]:
    from workbench.cluster.process import containment

    return {ip for record in cluster.tasks for ip, _ in containment.listeners(record.pid)}


def containment_main(args: argparse.Namespace) -> int:
    """Contained ports against every interface, alternating fresh clusters (see the module docstring)."""
    import workbench as wb
    from workbench.cluster.process.containment import BIND_ENV, EVERY_INTERFACE

    workers = 2
    modes = {"contained": {}, "every interface": {BIND_ENV: EVERY_INTERFACE}}
    rates: dict[str, dict[str, list[float]]] = {mode: {"async-ps": [], "allreduce": []} for mode in modes}
    for i in range(args.repeats):
        for mode, env in modes.items():
            with wb.Cluster(ps=1, workers=workers, progress=False, env=env) as cluster:
                addresses = _tensorflow_addresses(cluster)
                wide = bool(addresses & {"::", "0.0.0.0"})
                if wide != (mode == "every interface"):
                    raise RuntimeError(f"{mode}: the tasks listen on {sorted(addresses)}, not what this mode means")
                for strategy in ("async-ps", "allreduce"):
                    run = workbench_run(cluster, strategy=strategy, steps=args.steps, batch=args.per_worker_batch * workers,
                                        steps_per_call=args.steps_per_call)
                    rates[mode][strategy].append(run.steps_per_s)
            print(f"run {i + 1}/{args.repeats} {mode:15s}: async-ps {rates[mode]['async-ps'][-1]:6.1f} steps/s, "
                  f"allreduce {rates[mode]['allreduce'][-1]:6.1f} steps/s (listening on {sorted(addresses)})", flush=True)
    medians = {mode: {k: statistics.median(v) for k, v in by.items()} for mode, by in rates.items()}
    for strategy in ("async-ps", "allreduce"):
        contained, wide = medians["contained"][strategy], medians["every interface"][strategy]
        print(f"{strategy:10s} contained {contained:6.1f} steps/s, every interface {wide:6.1f}: ratio {contained / wide:.2f}")
    path = args.json.with_name("containment.json") if args.json.name == "training.json" else args.json
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"estimator": f"steady-state rate between {WINDOW[0]:.0%} and {WINDOW[1]:.0%} of each "
                                             "run's steps", "medians": medians, "raw": rates}, indent=2))
    return 0


def batch_losses_callback():
    """The custom callback of ``--callbacks``: what a user's own typically does (keeps the batch losses, reads the
    learning rate at each epoch's end)."""
    import keras

    class BatchLosses(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.losses, self.rates = [], []

        def on_train_batch_end(self, batch, logs=None):
            self.losses.append(logs["loss"])

        def on_epoch_end(self, epoch, logs=None):
            self.rates.append(float(keras.ops.convert_to_tensor(self.model.optimizer.learning_rate)))

    return BatchLosses()


def compare_fits(args: argparse.Namespace, modes: dict, baseline: str, json_name: str) -> int:
    """async-ps runs of each of ``modes`` (a name -> the fit keywords, a function called before each run), alternating
    their order, on one cluster; the medians and their ratios to ``baseline``, written to ``json_name``."""
    import workbench as wb

    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    batch = args.per_worker_batch * args.workers
    with wb.Cluster(ps=1, workers=args.workers, progress=False) as cluster:
        workbench_run(cluster, strategy="async-ps", steps=args.steps // 3, batch=batch, steps_per_call=args.steps_per_call)
        for i in range(args.repeats):
            order = list(modes) if i % 2 == 0 else list(modes)[::-1]
            for mode in order:
                # an ended job's functions are removed from the tasks when it is freed, each an RPC with the GIL
                # held: free the last one now, not in the middle of the next measured run
                gc.collect()
                run = workbench_run(cluster, strategy="async-ps", steps=args.steps, batch=batch,
                                    steps_per_call=args.steps_per_call, fit=modes[mode])
                rates[mode].append(run.steps_per_s)
            print(f"run {i + 1}/{args.repeats}: " + ", ".join(f"{m} {rates[m][-1]:6.1f}" for m in modes) + " steps/s",
                  flush=True)
    medians = {mode: statistics.median(values) for mode, values in rates.items()}
    base = medians[baseline]
    for mode, value in medians.items():
        print(f"async-ps {mode:22s} {value:7.1f} steps/s  ratio to {baseline} {value / base:.3f}")
    path = args.json.with_name(json_name) if args.json.name == "training.json" else args.json
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"estimator": f"steady-state rate between {WINDOW[0]:.0%} and {WINDOW[1]:.0%} of each "
                                             "run's steps", "workers": args.workers, "steps": args.steps, "epochs": EPOCHS,
                                "medians": medians, "ratios": {m: v / base for m, v in medians.items()}, "raw": rates},
                               indent=2))
    return 0


EPOCHS = 6  # of the --callbacks and --tracking runs


def callbacks_main(args: argparse.Namespace) -> int:
    """async-ps with Keras's TensorBoard callback and a custom one, against the same job without callbacks."""
    import shutil
    import tempfile

    import keras

    logs = Path(tempfile.mkdtemp(prefix="workbench-bench-tb-"))

    def with_callbacks() -> dict:
        shutil.rmtree(logs, ignore_errors=True)
        return {"epochs": EPOCHS, "steps_per_epoch": args.steps // EPOCHS,
                "callbacks": [keras.callbacks.TensorBoard(str(logs)), batch_losses_callback()]}

    def epochs_only() -> dict:
        return {"epochs": EPOCHS, "steps_per_epoch": args.steps // EPOCHS}

    try:
        return compare_fits(args, {"no callbacks": None, "epochs, no callbacks": epochs_only,
                                   "TensorBoard + custom": with_callbacks}, "no callbacks", "callbacks.json")
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def tracking_main(args: argparse.Namespace) -> int:
    """async-ps with ``wb.tracking.MLflow()`` (a SQLite store, MLflow's local default) or ``WandB`` (offline), against
    the same epochs without a tracker."""
    import shutil
    import tempfile

    import workbench as wb

    folder = Path(tempfile.mkdtemp(prefix="workbench-bench-tracking-"))
    if args.tracking == "mlflow":
        import mlflow

        mlflow.set_tracking_uri(f"sqlite:///{folder / 'mlflow.db'}")
        mlflow.set_experiment(experiment_id=mlflow.create_experiment("bench", artifact_location=str(folder / "artifacts")))

        def tracker():
            return wb.tracking.MLflow()
    else:
        import wandb

        def tracker():
            return wb.tracking.WandB(project="bench", mode="offline", dir=folder, settings=wandb.Settings(silent=True))

    def tracked() -> dict:
        return {"epochs": EPOCHS, "steps_per_epoch": args.steps // EPOCHS, "callbacks": [tracker()]}

    def epochs_only() -> dict:
        return {"epochs": EPOCHS, "steps_per_epoch": args.steps // EPOCHS}

    try:
        return compare_fits(args, {"no tracking": epochs_only, f"{args.tracking}": tracked}, "no tracking",
                            f"tracking-{args.tracking}.json")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600, help="steps of each async-ps, PSS and allreduce run")
    parser.add_argument("--sync-steps", type=int, help="steps of each sync-ps and SyncReplicas run (default: steps // 2)")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--per-worker-batch", type=int, default=32)
    parser.add_argument("--steps-per-call", type=int, default=10, help="the workbench's steps_per_call, and PSS's K")
    parser.add_argument("--lines", help="comma-separated line names to run (default: all): pss-k, async-ps, "
                        "async-ps-unpacked, async-ps-overlap, pss-1, tf1-k0, sync-ps-k0, tf1-k1, sync-ps-k1, allreduce")
    parser.add_argument("--containment", action="store_true", help="contained ports against every interface")
    parser.add_argument("--callbacks", action="store_true", help="async-ps with Keras callbacks against without")
    parser.add_argument("--tracking", choices=["mlflow", "wandb"], help="async-ps with wb.tracking's callback "
                        "against the same epochs without")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "training.json")
    args = parser.parse_args()
    if args.sync_steps is None:
        args.sync_steps = args.steps // 2
    if args.containment:
        return containment_main(args)
    if args.callbacks:
        return callbacks_main(args)
    if args.tracking:
        return tracking_main(args)
    return training_main(args)


if __name__ == "__main__":
    sys.exit(main())
