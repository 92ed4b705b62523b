"""Time to accuracy: how long each strategy takes to reach a held-out accuracy, against TensorFlow's own and one process.

Steps per second flatter asynchronous training (a stale worker's step counts as much as a fresh one's); what a
user feels is the wall-clock time until the model is good enough. Every side trains the same model
(``tta_workloads``: the digits MLP, or a small CNN on the digits upsampled to 32x32) from the same initial
distribution with Adam (``--learning-rate``), ``--steps-per-call`` K steps per remote call (per execution), a
global batch of 2 x ``--per-worker-batch`` (a worker's batch in the asynchronous sides), and judges its weights at
the end of every epoch of ``--epoch-steps`` optimizer steps with the same NumPy evaluation of the held-out digits
(``TargetClock``), whose seconds are kept off the clock. It stops at the first epoch end at ``--target``.

Sides, each on a 1 ps + 2 worker cluster: the workbench's on one ``wb.Cluster(ps=1, workers=2)``; PSS and SyncReplicas
on the tasks of a second, alike (a TensorFlow client's contexts stay on the tasks it used for TensorFlow's keep-alive,
10 minutes, after it exits, and PSS's slowed the set-up of the workbench's next job on the same tasks: its input
pipelines 0.22 s -> 0.37-0.41 s on the CNN); MWMS on ports of its own:

- ``async-ps``, ``sync-ps k=0``, ``sync-ps k=1`` (``backup_workers``), ``allreduce``: ``wb.train`` in this process
  (the kernel), the clock a Keras callback;
- their TensorFlow baselines (``tta_baselines``): ``pss`` (ParameterServerStrategy + ClusterCoordinator as TF's
  guide writes it), ``sync-replicas k=0`` and ``k=1`` (TF1 ``SyncReplicasOptimizer``), ``mwms``
  (MultiWorkerMirroredStrategy with a custom loop, two worker processes);
- ``local``: one process, Keras ``fit``.

Two clocks per run: **from the call** (the training call made, set-up included: building the model, connecting,
tracing, the first calls; what an interactive user waits for; a baseline process's ``import tensorflow`` and
data loading are not counted, the workbench's cluster is already running), and **from the first call** (from the
end of the first call of K steps: the training alone). Each workbench side first trains once apart (the
kernel's first job of a kind connects, and traces the step function later async-ps jobs of its program call: its
time from the call is reported beside the medians; a baseline's run is a fresh process each time, its own set-up
counted from its call). Within each repeat the sides alternate, the order reversed
every other repeat; figures are medians over ``--repeats`` (at least 5 for a reported figure), with min-max.
Repeat r trains every side with seed ``--seed`` + r: the epochs a run needs to reach the target depend on its
initial weights and the order of its data (on the MLP, 5 to 7 epochs over seeds 0 to 4), and a seed shared by all
repeats would measure one draw of that luck. Sides that run the same algorithm draw the same: one process, MWMS,
all-reduce and sync-ps k=0 start from the same weights and train on the same global batches (``tta_baselines``),
so in a repeat they reach the target at the same epoch (rounding aside) and their ratios compare speed alone.
Ratios: baseline / workbench (> 1: the workbench is sooner), side / one process (> 1: slower than one process).
Beside them, each side's time an epoch on the clock (between two judgements; the median of each run's, over the
repeats) and, for a workbench side, its baseline's over it: a time to the target is about that times the epochs,
and where two sides' algorithms differ (async against sync, PSS's unseeded data), which needed an epoch more is
partly the seeds' draw (``--repeats`` many to even it out).
The async-ps sides also report their staleness: for each step, how many of the other worker's updates landed
between its read of the parameters and its own update, over every step of every repeat (mean, 90th and 99th
percentile, max).

    python bench/time_to_accuracy.py [--workloads mlp,cnn] [--repeats 5] [--target 0.95] [--sides ...]

``--gpu`` (``make bench-gpu``, on a machine with NVIDIA GPUs): the workbench's workers one GPU each (as many as the
GPUs, ``--workers`` fewer), and by default all-reduce, async-ps, and the ps strategies with bf16 transfer (async-ps
with overlapped reads too) against one process on the first GPU. Elsewhere it says why it skips and exits 0.

    python bench/time_to_accuracy.py --gpu [--workloads cnn] [--repeats 5]

``--crossover`` instead trains the CNN at several widths (``--widths``, filters x width: compute per step grows
about as width squared) with async-ps (both ways of reading), all-reduce and one process, and reports each
strategy's time to the target over one process's per width: where distributing starts to pay on this machine.

    python bench/time_to_accuracy.py --crossover [--widths 1,2,4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from pathlib import Path

import tta_baselines
from gpu import gpu_machine, on_gpus, step_devices, write
from tta_workloads import DATA, WORKLOADS, TargetClock, loss, model_fn, time_to_target

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
TIMEOUT = 600.0  # seconds any one run may take
WORKBENCH_SIDES = ("async-ps", "sync-ps k=0", "sync-ps k=1", "allreduce")
# measured on request (--sides): wb.AsyncPS(overlap=True), each step's parameters read while the step before runs;
# the ps strategies' parameters and gradients in bfloat16 (on the GPUs, by default)
VARIANTS = ("async-ps overlap", "async-ps bf16 overlap", "sync-ps bf16")
BASELINE_OF = {"async-ps": "pss", "sync-ps k=0": "sync-replicas k=0", "sync-ps k=1": "sync-replicas k=1",
               "allreduce": "mwms"}
SIDES = (*WORKBENCH_SIDES, *BASELINE_OF.values(), "local")
KNOWN_SIDES = (*SIDES, *VARIANTS)
ESTIMATED = ("async-ps", "async-ps overlap", "sync-ps k=0", "sync-ps k=1")  # what wb.estimate models
CROSSOVER_SIDES = ("async-ps", "async-ps overlap", "allreduce", "local")
GPU_SIDES = ("allreduce", "async-ps", "async-ps bf16 overlap", "sync-ps bf16", "local")
RESULTS = Path(__file__).resolve().parent / "results"


def config_of(args: argparse.Namespace, workload: str, width: float) -> dict:
    """What every side is told (the baselines' processes get it as JSON)."""
    return {"workload": workload, "width": width, "target": args.target, "epoch_steps": args.epoch_steps,
            "max_epochs": args.max_epochs, "steps_per_call": args.steps_per_call, "per_worker_batch": args.per_worker_batch,
            "global_batch": 2 * args.per_worker_batch, "learning_rate": args.learning_rate, "seed": args.seed}


def strategy_of(side: str, k: int):
    """The ``wb.train`` strategy of a workbench side, ``k`` steps a call."""
    import workbench as wb

    return {"async-ps": lambda: wb.AsyncPS(steps_per_call=k),
            "async-ps overlap": lambda: wb.AsyncPS(steps_per_call=k, overlap=True),
            "async-ps bf16 overlap": lambda: wb.AsyncPS(steps_per_call=k, overlap=True, transfer="bf16"),
            "sync-ps bf16": lambda: wb.SyncPS(steps_per_call=k, transfer="bf16"),
            "allreduce": lambda: wb.AllReduce(steps_per_call=k),
            "sync-ps k=0": lambda: wb.SyncPS(steps_per_call=k),
            "sync-ps k=1": lambda: wb.SyncPS(steps_per_call=k, backup_workers=1)}[side]()


def workbench_side(cluster, side: str, config: dict) -> dict:
    """One ``wb.train`` to the target in this process; its clock's record."""
    import keras

    import workbench as wb
    from workbench.telemetry.job_scalars import step_staleness

    strategy = strategy_of(side, config["steps_per_call"])
    cursor = cluster.telemetry.cursor
    clock = TargetClock(config["workload"], config["target"])
    callback = clock.keras_callback()
    clock.call = time.time()
    job = wb.train(cluster, model_fn(config["workload"], config["width"]), DATA[config["workload"]],
                   loss(), keras.optimizers.Adam(config["learning_rate"]), strategy=strategy, epochs=config["max_epochs"],
                   steps_per_epoch=config["epoch_steps"], batch_size=config["global_batch"], seed=config["seed"],
                   callbacks=[callback])
    try:
        job.wait(TIMEOUT)
    except TimeoutError:
        job.stop()
        raise
    if job.state != "finished":
        raise RuntimeError(f"{side}: job {job.name} {job.state}: {job.error}")
    stale = None
    if side.startswith("async-ps"):  # how many of the other worker's updates landed during each step
        stale = [n for counts in step_staleness(job.history).values() for n in counts]
    return clock.result(steps=job.steps_done, staleness=stale, devices=step_devices(cluster, cursor, job.name))


def run_side(cluster, side: str, config: dict, baselines_cluster=None) -> dict:
    """One run of ``side``: the workbench's sides on ``cluster``; PSS and SyncReplicas on ``baselines_cluster``'s tasks."""
    tasks = (baselines_cluster or cluster).spec_dict
    if side in WORKBENCH_SIDES or side in VARIANTS:
        return workbench_side(cluster, side, config)
    if side == "local":
        return tta_baselines.run_local(config, TIMEOUT)
    if side == "pss":
        return tta_baselines.run_pss(tasks, config, TIMEOUT)
    if side == "mwms":
        return tta_baselines.run_mwms(len(cluster.spec_dict["worker"]), config, TIMEOUT)
    return tta_baselines.run_sync_replicas(tasks, config, int(side[-1]), TIMEOUT)


def estimate_of(cluster, side: str, config: dict, record: dict) -> dict:
    """``wb.estimate`` of a ps side's run ``record``, as a user would call it: profiled on this cluster's unshaped
    links with the side's epochs, its data and its loss (a link of 100 Gbit/s adds next to nothing to what the
    profile measured on loopback), right after the run, and given the epochs that run took. Profiled once before
    the repeats instead, it missed by up to 30 % on a machine whose speed drifted by as much within minutes; the
    profile trains the side's program, so the runs after it keep their step functions."""
    import workbench as wb

    predicted = wb.estimate(model_fn(config["workload"], config["width"]), cluster, config["global_batch"],
                            strategy_of(side, config["steps_per_call"]), link="100gbit",
                            steps_per_epoch=config["epoch_steps"], data=DATA[config["workload"]], loss=loss())
    seconds = predicted.seconds_for(record["epochs"] * config["epoch_steps"])
    measured = math.inf if record["from_call"] is None else record["from_call"]
    return {"setup_seconds": predicted.profile.setup_seconds, "step_seconds": predicted.step_seconds,
            "from_call": seconds, "over_measured": _ratio(seconds, measured)}


def measure(cluster, args: argparse.Namespace, cases: list[tuple[str, float]], sides: list[str],
            baselines_cluster=None) -> dict:
    """``raw[case][side]``: one record per repeat (time to target from the call and from the first call, epochs);
    with ``--estimate``, each ps side's record also holds ``estimate`` (``estimate_of``)."""
    raw: dict[str, dict[str, list]] = {}
    for workload, width in cases:
        case = case_name(workload, width)
        config = config_of(args, workload, width)
        raw[case] = {side: [] for side in sides}
        raw[case]["first_job"] = {}  # the kernel's first job of a kind connects, and traces what the next ones of
        for side in (s for s in sides if s in WORKBENCH_SIDES or s in VARIANTS):  # its program reuse: reported apart
            record = time_to_target(run_side(cluster, side, config), args.target)
            raw[case]["first_job"][side] = record
            print(f"  {case} first job: {side:18s} {_brief({**record, 'error': None})}", flush=True)
        for repeat in range(args.repeats):
            seeded = {**config, "seed": args.seed + repeat}  # one draw of weights and data order per repeat, every side's
            for side in (sides if repeat % 2 == 0 else list(reversed(sides))):
                try:
                    result = run_side(cluster, side, seeded, baselines_cluster)
                    record = {**time_to_target(result, args.target), "error": None, "staleness": result.get("staleness")}
                    if args.gpu and side != "local":
                        record["devices"] = result["devices"]
                        record["error"] = off_the_gpus(result["devices"])
                except Exception as exc:  # noqa: BLE001 - a failed side is reported and left out
                    record = {"from_call": None, "from_first": None, "epochs": 0, "accuracy": 0.0, "epoch_seconds": None,
                              "error": f"{type(exc).__name__}: {exc}"[:2000]}
                record["seed"] = seeded["seed"]
                if args.estimate and side in ESTIMATED and record["error"] is None:  # a failed run has no epochs
                    record["estimate"] = estimate_of(cluster, side, seeded, record)
                raw[case][side].append(record)
                print(f"  {case} repeat {repeat + 1}: {side:18s} {_brief(record)}", flush=True)
    return raw


def case_name(workload: str, width: float) -> str:
    return workload if width == 1.0 else f"{workload} x{width:g}"


def _brief(record: dict) -> str:
    if record["error"]:
        return "failed: " + record["error"].splitlines()[0][:160]
    if record["from_call"] is None:
        return f"target not reached in {record['epochs']} epochs (best {record['accuracy']:.3f})"
    return f"{record['from_call']:.2f} s from the call, {record['from_first']:.2f} s from the first call, " \
           f"{record['epochs']} epochs"


def stats(records: list[dict], key: str) -> dict:
    """Median and spread of ``key`` over the repeats; a repeat that failed or missed the target counts as infinite."""
    values = [math.inf if r[key] is None else r[key] for r in records]
    finite = [v for v in values if math.isfinite(v)]
    return {"median": statistics.median(values) if values else math.inf, "min": min(finite, default=math.inf),
            "max": max(finite, default=math.inf), "missed": len(values) - len(finite), "n": len(values)}


def summarize(raw: dict) -> dict:
    summary = {}
    for case, sides in raw.items():
        rows = {side: {key: stats(records, key) for key in ("from_call", "from_first")} |
                {"epochs": statistics.median([r["epochs"] for r in records]), "epoch_seconds": _median_epoch(records)}
                for side, records in sides.items() if side != "first_job"}
        for side, record in sides.get("first_job", {}).items():
            rows[side]["first_job_from_call"] = record["from_call"]
        for side in rows:
            counts = sorted(n for r in sides[side] if r.get("staleness") for n in r["staleness"])
            if counts:  # async-ps: the distribution over every step of every repeat
                rows[side]["staleness"] = {"mean": statistics.mean(counts), "p90": counts[int(0.9 * len(counts))],
                                           "p99": counts[int(0.99 * len(counts))], "max": counts[-1], "steps": len(counts)}
        for side in rows:  # each repeat's estimate against its own run: medians, and the spread of the ratio
            predicted = [r["estimate"] for r in sides[side] if "estimate" in r]
            if predicted:
                ratios = [e["over_measured"] for e in predicted if math.isfinite(e["over_measured"])]
                rows[side]["estimate"] = {key: statistics.median(e[key] for e in predicted)
                                          for key in ("setup_seconds", "step_seconds", "from_call")}
                rows[side]["estimate"].update(over_measured=statistics.median(ratios) if ratios else math.nan,
                                              over_measured_min=min(ratios, default=math.nan),
                                              over_measured_max=max(ratios, default=math.nan))
        local = rows.get("local")
        for side, row in rows.items():
            if side in BASELINE_OF and BASELINE_OF[side] in rows and row["epoch_seconds"] and rows[BASELINE_OF[side]]["epoch_seconds"]:
                row["epoch_baseline_over_workbench"] = rows[BASELINE_OF[side]]["epoch_seconds"] / row["epoch_seconds"]
            for key in ("from_call", "from_first"):
                if side in BASELINE_OF and BASELINE_OF[side] in rows:
                    row[key]["baseline_over_workbench"] = _ratio(rows[BASELINE_OF[side]][key]["median"], row[key]["median"])
                if local is not None and side != "local":
                    row[key]["over_local"] = _ratio(row[key]["median"], local[key]["median"])
        summary[case] = rows
    return summary


def _median_epoch(records: list[dict]) -> float | None:
    """The median over the repeats of each run's median time an epoch (``time_to_target``'s ``epoch_seconds``)."""
    values = [r["epoch_seconds"] for r in records if r.get("epoch_seconds") is not None]
    return statistics.median(values) if values else None


def _ratio(a: float, b: float) -> float:
    return a / b if math.isfinite(a) and math.isfinite(b) and b > 0 else math.nan


def print_report(summary: dict, target: float) -> None:
    for case, rows in summary.items():
        print(f"\n{case}: seconds to held-out accuracy {target} (median [min-max] over repeats)")
        print(f"  {'side':18s} {'from the call':>24s} {'from the first call':>24s} {'epochs':>6s}  ratios")
        for side, row in rows.items():
            cells = [_cell(row[key]) for key in ("from_call", "from_first")]
            ratios = []
            for key, label in (("from_call", "call"), ("from_first", "first")):
                if "baseline_over_workbench" in row[key]:
                    ratios.append(f"{BASELINE_OF[side]}/this ({label}) {row[key]['baseline_over_workbench']:.2f}")
                if "over_local" in row[key]:
                    ratios.append(f"/local ({label}) {row[key]['over_local']:.2f}")
            if row["epoch_seconds"] is not None:
                ratios.append(f"{row['epoch_seconds'] * 1e3:.1f} ms an epoch" + (
                    f" ({BASELINE_OF[side]}/this {row['epoch_baseline_over_workbench']:.2f})"
                    if "epoch_baseline_over_workbench" in row else ""))
            if row.get("first_job_from_call") is not None:
                ratios.append(f"the kernel's first job of it {row['first_job_from_call']:.2f} s from the call")
            if "staleness" in row:
                stale = row["staleness"]
                ratios.append(f"staleness mean {stale['mean']:.2f}, p90 {stale['p90']}, p99 {stale['p99']}, "
                              f"max {stale['max']} ({stale['steps']} steps)")
            if "estimate" in row:
                guess = row["estimate"]
                ratios.append(f"wb.estimate {guess['from_call']:.2f} s from the call ({guess['over_measured']:.2f} of "
                              f"measured [{guess['over_measured_min']:.2f}-{guess['over_measured_max']:.2f}])")
            print(f"  {side:18s} {cells[0]:>24s} {cells[1]:>24s} {row['epochs']:>6g}  {'; '.join(ratios)}")


def _cell(entry: dict) -> str:
    if not math.isfinite(entry["median"]):
        return f"missed {entry['missed']}/{entry['n']}"
    missed = f" ({entry['missed']} missed)" if entry["missed"] else ""
    return f"{entry['median']:.2f} [{entry['min']:.2f}-{entry['max']:.2f}]{missed}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--sides", help="a comma-separated list of " + ", ".join(KNOWN_SIDES) + " (default: all but the "
                        "variants; with --crossover " + ", ".join(CROSSOVER_SIDES) + ")")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--target", type=float, default=0.97)
    parser.add_argument("--epoch-steps", type=int, default=20)
    parser.add_argument("--max-epochs", type=int, default=60)
    parser.add_argument("--steps-per-call", type=int, default=10)
    parser.add_argument("--per-worker-batch", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=0.001)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--crossover", action="store_true")
    parser.add_argument("--estimate", action="store_true", help="also predict each ps side's time from the call with "
                        "wb.estimate, profiled right after each of its runs and given the epochs that run took")
    parser.add_argument("--widths", default="1,2,4")
    parser.add_argument("--gpu", action="store_true", help="the workers on GPUs, one each (default sides: "
                        + ", ".join(GPU_SIDES) + "); skips, saying why, where there is none")
    parser.add_argument("--workers", type=int, help="with --gpu: at most this many workers (default: one per GPU)")
    parser.add_argument("--json", type=Path, help="default: bench/results/time_to_accuracy[_gpu].json")
    args = parser.parse_args(argv)
    args.sides = args.sides or ",".join(CROSSOVER_SIDES if args.crossover else GPU_SIDES if args.gpu else SIDES)
    args.json = args.json or RESULTS / ("time_to_accuracy_gpu.json" if args.gpu else "time_to_accuracy.json")
    if args.workers is not None and (not args.gpu or args.workers < 1):
        parser.error("--workers is for --gpu runs, and is 1 or more")
    unknown = [s for s in args.sides.split(",") if s not in KNOWN_SIDES]
    if unknown:
        parser.error(f"no side named {', '.join(unknown)}: the sides are {', '.join(KNOWN_SIDES)}")
    bad = [w for w in args.workloads.split(",") if w not in WORKLOADS]
    if bad:
        parser.error(f"no workload named {', '.join(bad)}: the workloads are {', '.join(WORKLOADS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    import workbench as wb

    args = parse_args(argv)
    if args.crossover:
        cases = [("cnn", float(w)) for w in args.widths.split(",")]
    else:
        cases = [(w, 1.0) for w in args.workloads.split(",")]
    sides = args.sides.split(",")
    started = time.time()
    shape = dict(workers=2)
    if args.gpu:
        gpus, reason = gpu_machine()
        if reason:
            print(f"bench/time_to_accuracy.py --gpu skipped: {reason}")
            write(args.json, {"skipped": reason})
            return 0
        shape = dict(workers=min(args.workers or len(gpus), len(gpus)), gpus_per_worker=1)
    on_tasks = any(s == "pss" or s.startswith("sync-replicas") for s in sides)  # baselines that use a cluster's tasks
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(wb.Cluster(ps=1, **shape, name="wb-bench-tta", progress=False))
        baselines_cluster = stack.enter_context(wb.Cluster(ps=1, workers=2, name="wb-bench-tta-baselines",
                                                           progress=False)) if on_tasks else None
        raw = measure(cluster, args, cases, sides, baselines_cluster)
    summary = summarize(raw)
    print_report(summary, args.target)
    print(f"\n({time.time() - started:.0f} s in all; python bench/time_to_accuracy.py {' '.join(sys.argv[1:])})")
    write(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "raw": raw})
    failed = any(r["error"] for sides_ in raw.values() for side, records in sides_.items()
                 if side != "first_job" for r in records)
    return 1 if failed else 0


def off_the_gpus(devices: list[str]) -> str | None:
    """What is wrong with a ``--gpu`` run whose workers' steps ran on ``devices`` (None: every one a GPU)."""
    if on_gpus(devices):
        return None
    return f"its steps ran on {', '.join(devices) or 'no device the telemetry saw'}, not the workers' GPUs"


if __name__ == "__main__":
    sys.exit(main())
