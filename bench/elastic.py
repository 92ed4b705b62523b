"""What scaling a cluster costs a job that trains on it, and what it gains (``cluster.scale`` mid-job).

For each strategy (async-ps, sync-ps) and each model, a job starts on 1 ps + 1 worker; once it has
trained ``--window`` seconds after ``--warmup``, ``cluster.scale(workers=3)`` runs in the notebook's
place (this process), the job adopts the two new workers at its next step boundary, trains
``--settle`` + ``--window`` more seconds, and is stopped. Reported per case (medians of ``--repeats``):

- pause: from the scale's request (engines already started: ``scale()`` returns before the job
  follows) until the new workers' first calls, from ``job.events``: ``drain_seconds`` (the old
  workers' calls in flight come back; no new ones start) + ``pause_seconds`` (input pipelines and
  the connection made again);
- examples/s before (the window before the request) and after (a window starting ``--settle`` s
  after the new workers' first step, so that their first calls' set-up is not counted), from the
  job's own history on the workers' clocks, and their ratio.

Models: ``compute`` (an MLP of 3 x 1024 units on digits: the workers' CPU is the limit, and this
machine has 2 cores for 4 tasks, so more workers cannot add much here) and ``link`` (the digits MLP
with every worker's link shaped to ``--rate``: each worker waits on its own link, so the rate grows
with the workers until the ps's link or the CPUs are the limit). Needs root for the netns links;
otherwise the user-space relay carries them (``network="auto"``).

    python bench/elastic.py [--repeats 3] [--window 6] [--rate 10mbit] [--json bench/results/elastic.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import keras
from training_helpers import LOSS, make_model, wait_for

import workbench as wb
from workbench.training import strategy_named

STRATEGIES = ("async-ps", "sync-ps")
MODELS = ("compute", "link")
STEPS = 10**6  # the job is stopped after the windows; it never runs out of steps


def wide_model():
    return keras.Sequential([keras.Input((64,)), *(keras.layers.Dense(1024, activation="relu") for _ in range(3)),
                             keras.layers.Dense(10)])


def rate_between(history: list[dict], start: float, end: float) -> float:
    """Examples per second of the steps that ran wholly in ``[start, end)`` (workers' clocks)."""
    steps = [r for r in history if r["start"] >= start and r["end"] < end]
    if len(steps) < 2:
        return float("nan")
    span = max(r["end"] for r in steps) - min(r["start"] for r in steps)
    return sum(r["examples"] for r in steps) / max(span, 1e-9)


def one_case(strategy: str, model: str, args) -> dict:
    network = None if model == "compute" else "auto"
    with wb.Cluster(ps=1, workers=1, progress=False, network=network, name=f"wb-bench-elastic-{strategy}") as cluster:
        if model == "link":
            cluster.shape(rate=args.rate, between="worker")
        job = wb.train(cluster, wide_model if model == "compute" else make_model, wb.datasets.digits, LOSS,
                       keras.optimizers.Adam(0.001), strategy=strategy_named(strategy, steps_per_call=5), steps=STEPS,
                       batch_size=32, seed=1)
        try:
            wait_for(lambda: job.steps_done > 0 or job.state != "running", 180, "the first step")
            time.sleep(args.warmup + args.window)
            asked = time.time()
            cluster.scale(workers=3)
            wait_for(lambda: job.events or job.state != "running", 120, "the job to follow the scale")
            joined = {"worker:1", "worker:2"}
            wait_for(lambda: any(joined & set(r["worker"].split(",")) for r in job.history), 120, "the new workers' first step")
            first_new = min(r["start"] for r in job.history if joined & set(r["worker"].split(",")))
            time.sleep(args.settle + args.window + 1.0)
        finally:
            job.stop()
        if job.error is not None:
            raise job.error
        history, event = job.history, job.events[0]
        offsets = cluster.clock_offsets()
        skew = offsets.get("worker:0", 0.0)  # the workers' clock against this process's (the request's time)
        before = rate_between(history, asked + skew - args.window, asked + skew)
        after_start = first_new + args.settle
        after = rate_between(history, after_start, after_start + args.window)
        return {"strategy": strategy, "model": model, "drain_s": event["drain_seconds"], "pause_s": event["pause_seconds"],
                "total_pause_s": event["drain_seconds"] + event["pause_seconds"], "before_examples_per_s": before,
                "after_examples_per_s": after, "after_over_before": after / before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--window", type=float, default=6.0)
    parser.add_argument("--settle", type=float, default=2.0)
    parser.add_argument("--rate", default="10mbit", help="each worker's link for the link-bound model (tc's notation)")
    parser.add_argument("--only", nargs="*", default=[], help="cases as strategy/model, e.g. async-ps/link")
    parser.add_argument("--json", help="write every repeat's figures here")
    args = parser.parse_args()
    cases = [(s, m) for m in MODELS for s in STRATEGIES if not args.only or f"{s}/{m}" in args.only]
    runs: dict[tuple[str, str], list[dict]] = {case: [] for case in cases}
    for repeat in range(args.repeats):  # the cases alternate within each repeat: the machine's noise spreads over all
        for case in cases:
            result = one_case(*case, args)
            runs[case].append(result)
            print(f"repeat {repeat + 1}: {case[0]:8} {case[1]:7} pause {result['total_pause_s']:.2f} s "
                  f"(drain {result['drain_s']:.2f} + {result['pause_s']:.2f}), examples/s "
                  f"{result['before_examples_per_s']:.0f} -> {result['after_examples_per_s']:.0f} "
                  f"({result['after_over_before']:.2f}x)", flush=True)
    print(f"\nmedians of {args.repeats} (1 ps; 1 -> 3 workers; per-worker batch 32)")
    print(f"{'strategy':9} {'model':8} {'pause s':>8} {'drain s':>8} {'before ex/s':>12} {'after ex/s':>11} {'after/before':>13}")
    for (strategy, model), results in runs.items():
        median = {key: statistics.median(r[key] for r in results) for key in results[0] if key not in ("strategy", "model")}
        print(f"{strategy:9} {model:8} {median['total_pause_s']:8.2f} {median['drain_s']:8.2f} "
              f"{median['before_examples_per_s']:12.0f} {median['after_examples_per_s']:11.0f} {median['after_over_before']:13.2f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([r for results in runs.values() for r in results], indent=2))


if __name__ == "__main__":
    main()
