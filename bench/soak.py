"""A long-lived kernel: 50 jobs back to back in one client process, a worker killed every 10th job.

One 1 ps + 2 worker cluster; jobs of 60 steps cycle through async-ps, sync-ps and allreduce (the
digits MLP, global batch 64). Every 10th job has ``worker:1``'s engine killed (SIGKILL) after its
first step; recovery re-hosts it and the job finishes. For each job: time to first step (from the
``wb.train`` call to the first step in ``job.history``, polled every 10 ms), the job's wall time, the
client's RSS and its thread count (Python threads and OS threads) after the job. Goals: every time
to first step <= 3 s, median <= 1 s; RSS growth from job 10 to job 50 <= 30 MiB; threads flat.

    python bench/soak.py [--jobs 50] [--steps 60] [--json bench/results/soak.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

GOAL_MAX_FIRST_STEP_S = 3.0
GOAL_MEDIAN_FIRST_STEP_S = 1.0
GOAL_RSS_GROWTH_MIB = 30.0
STRATEGIES = ("async-ps", "sync-ps", "allreduce")
KILL_EVERY = 10
JOB_TIMEOUT_S = 300.0


def one_job(cluster, index: int, steps: int, kill: bool) -> dict:
    import keras
    import psutil

    import workbench as wb

    def make_model():
        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])

    strategy = STRATEGIES[index % len(STRATEGIES)]
    called = time.monotonic()
    job = wb.train(cluster, make_model, wb.datasets.digits, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   "adam", metrics=["accuracy"], strategy=strategy, steps=steps, batch_size=64, seed=index)
    deadline = called + JOB_TIMEOUT_S
    while job.steps_done == 0 and job.state == "running" and time.monotonic() < deadline:
        time.sleep(0.01)
    first_step = time.monotonic() - called
    if kill:
        os.kill(cluster.task("worker:1").pid, signal.SIGKILL)
    job.wait(max(1.0, deadline - time.monotonic()))
    me = psutil.Process()
    return {"job": index + 1, "name": job.name, "strategy": strategy, "state": job.state, "steps": job.steps_done,
            "first_step_s": first_step, "wall_s": time.monotonic() - called, "killed_worker": kill,
            "faults": [f"{f['task']} {f['kind']} -> {f['action']}" for f in job.faults],
            "rss_mib": me.memory_info().rss / 2**20, "python_threads": threading.active_count(),
            "os_threads": me.num_threads()}


def summarize(runs: list[dict]) -> dict:
    firsts = [r["first_step_s"] for r in runs]
    by_job = {r["job"]: r for r in runs}
    base = by_job.get(10, runs[0])
    return {
        "jobs": len(runs),
        "finished": sum(r["state"] == "finished" for r in runs),
        "first_step_min_s": min(firsts), "first_step_median_s": statistics.median(firsts), "first_step_max_s": max(firsts),
        "rss_growth_from_job_10_mib": runs[-1]["rss_mib"] - base["rss_mib"],
        "os_threads_from_job_10": [base["os_threads"], runs[-1]["os_threads"]],
        "python_threads_from_job_10": [base["python_threads"], runs[-1]["python_threads"]],
        "goals": {"first_step_max_s": GOAL_MAX_FIRST_STEP_S, "first_step_median_s": GOAL_MEDIAN_FIRST_STEP_S,
                  "rss_growth_mib": GOAL_RSS_GROWTH_MIB},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "soak.json")
    args = parser.parse_args()
    import workbench as wb

    cluster = wb.Cluster(ps=1, workers=2, name="wb-bench-soak", progress=False).start()
    runs = []
    try:
        for index in range(args.jobs):
            run = one_job(cluster, index, args.steps, kill=(index + 1) % KILL_EVERY == 0)
            runs.append(run)
            print(f"job {run['job']:2d} {run['strategy']:9s} {run['state']:9s} {run['steps']:3d} steps  first step "
                  f"{run['first_step_s']:5.2f} s  wall {run['wall_s']:5.2f} s  rss {run['rss_mib']:7.1f} MiB  threads "
                  f"{run['python_threads']}/{run['os_threads']}" + (f"  killed worker:1: {run['faults']}" if run["killed_worker"] else ""),
                  flush=True)
    finally:
        cluster.stop()
    summary = summarize(runs)
    print(f"\n{summary['finished']}/{summary['jobs']} jobs finished\n"
          f"time to first step: min {summary['first_step_min_s']:.2f} s, median {summary['first_step_median_s']:.2f} s "
          f"(goal <= {GOAL_MEDIAN_FIRST_STEP_S}), max {summary['first_step_max_s']:.2f} s (goal <= {GOAL_MAX_FIRST_STEP_S})\n"
          f"client RSS growth, job 10 to {summary['jobs']}: {summary['rss_growth_from_job_10_mib']:+.1f} MiB "
          f"(goal <= {GOAL_RSS_GROWTH_MIB})\n"
          f"threads (Python/OS), job 10 -> {summary['jobs']}: {summary['python_threads_from_job_10']} / "
          f"{summary['os_threads_from_job_10']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"summary": summary, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
