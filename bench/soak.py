"""A long-lived kernel: jobs back to back in one client process, a worker killed every 10th job.

One 1 ps + 2 worker cluster; jobs of 60 steps cycle through async-ps, sync-ps and allreduce (the
digits MLP, global batch 64). Every 10th job has ``worker:1``'s engine killed (SIGKILL) after its
first step; recovery re-hosts it and the job finishes. For each job: time to first step (from the
``wb.train`` call to the first step in ``job.history``, polled every 10 ms), the job's wall time, the
client's RSS, its thread count (Python threads and OS threads) and its malloc heaps after the job. With ``--keep-jobs``
every ``Job`` stays referenced, as a user collecting a sweep's results keeps them. At the end,
``cluster.stop()`` is timed while a watchdog thread records the longest time no Python ran.

Goals: every time to first step <= 3 s; client RSS slope from job 10 on <= 0.3 MiB a job with the jobs
dropped, <= 0.5 MiB a job with them kept; Python threads flat between kills; ``cluster.stop()`` within
5 s with no stall over 1 s.

    python bench/soak.py [--jobs 100] [--steps 60] [--keep-jobs] [--json bench/results/soak.json]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from training_helpers import Watchdog  # the suite's: how long no Python ran

GOAL_MAX_FIRST_STEP_S = 3.0
GOAL_RSS_SLOPE_MIB = {False: 0.3, True: 0.5}  # per job from job 10 on: jobs dropped, jobs kept
GOAL_STOP_S = 5.0
GOAL_STALL_S = 1.0
STRATEGIES = ("async-ps", "sync-ps", "allreduce")
KILL_EVERY = 10
SLOPE_FROM_JOB = 10
JOB_TIMEOUT_S = 300.0


def one_job(cluster, index: int, steps: int, kill: bool):
    import keras
    import psutil

    import workbench as wb
    from workbench.cluster.machine.memory import malloc_arenas

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
    return job, {"job": index + 1, "name": job.name, "strategy": strategy, "state": job.state, "steps": job.steps_done,
                 "first_step_s": first_step, "wall_s": time.monotonic() - called, "killed_worker": kill,
                 "faults": [f"{f['task']} {f['kind']} -> {f['action']}" for f in job.faults],
                 "rss_mib": me.memory_info().rss / 2**20, "python_threads": threading.active_count(),
                 "os_threads": me.num_threads(), "malloc_arenas": malloc_arenas()}


def slope(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of ``(x, y)`` points (0 for fewer than two)."""
    if len(points) < 2:
        return 0.0
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0


def threads_flat_between_kills(runs: list[dict]) -> bool:
    """Python threads after each job equal those after the previous one, unless a kill came between."""
    return all(b["python_threads"] <= a["python_threads"] for a, b in zip(runs, runs[1:])
               if not b["killed_worker"] and not a["killed_worker"])


def summarize(runs: list[dict], keep: bool, stop_s: float, stop_stall_s: float, soak_stall_s: float) -> dict:
    firsts = [r["first_step_s"] for r in runs]
    late = [(r["job"], r["rss_mib"]) for r in runs if r["job"] >= SLOPE_FROM_JOB]
    return {
        "jobs": len(runs), "jobs_kept": keep,
        "finished": sum(r["state"] == "finished" for r in runs),
        "first_step_min_s": min(firsts), "first_step_median_s": statistics.median(firsts), "first_step_max_s": max(firsts),
        "rss_slope_mib_per_job": slope(late),
        "rss_from_job_10_mib": [late[0][1], late[-1][1]] if late else [],
        "python_threads_flat_between_kills": threads_flat_between_kills(runs),
        "python_threads_range": [min(r["python_threads"] for r in runs), max(r["python_threads"] for r in runs)],
        "stop_s": stop_s, "stop_longest_stall_s": stop_stall_s, "soak_longest_stall_s": soak_stall_s,
        "malloc_arenas_range": [min(r["malloc_arenas"] or 0 for r in runs), max(r["malloc_arenas"] or 0 for r in runs)],
        "goals": {"first_step_max_s": GOAL_MAX_FIRST_STEP_S, "rss_slope_mib_per_job": GOAL_RSS_SLOPE_MIB[keep],
                  "stop_s": GOAL_STOP_S, "stall_s": GOAL_STALL_S},
    }


def line(run: dict) -> str:
    killed = f"  killed worker:1: {run['faults']}" if run["killed_worker"] else ""
    return (f"job {run['job']:3d} {run['strategy']:9s} {run['state']:9s} {run['steps']:3d} steps  first step "
            f"{run['first_step_s']:5.2f} s  wall {run['wall_s']:5.2f} s  rss {run['rss_mib']:7.1f} MiB  threads "
            f"{run['python_threads']}/{run['os_threads']}  heaps {run['malloc_arenas']}{killed}")


def report(summary: dict) -> str:
    goals = summary["goals"]
    kept = "kept" if summary["jobs_kept"] else "dropped"
    return (f"\n{summary['finished']}/{summary['jobs']} jobs finished (jobs {kept})\n"
            f"time to first step: min {summary['first_step_min_s']:.2f} s, median {summary['first_step_median_s']:.2f} s, "
            f"max {summary['first_step_max_s']:.2f} s (goal <= {goals['first_step_max_s']})\n"
            f"client RSS slope from job {SLOPE_FROM_JOB}: {summary['rss_slope_mib_per_job']:+.3f} MiB a job "
            f"(goal <= {goals['rss_slope_mib_per_job']}; {summary['rss_from_job_10_mib']})\n"
            f"Python threads flat between kills: {summary['python_threads_flat_between_kills']} "
            f"(range {summary['python_threads_range']}); the client's malloc heaps {summary['malloc_arenas_range']}\n"
            f"cluster.stop(): {summary['stop_s']:.2f} s (goal <= {goals['stop_s']}), longest stall "
            f"{summary['stop_longest_stall_s']:.2f} s (goal <= {goals['stall_s']}); longest stall over the soak "
            f"{summary['soak_longest_stall_s']:.2f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--keep-jobs", action="store_true", help="keep every Job referenced (a sweep's results)")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "soak.json")
    args = parser.parse_args()
    import workbench as wb

    cluster = wb.Cluster(ps=1, workers=2, name="wb-bench-soak", progress=False).start()
    runs, kept = [], []
    stop_s = stop_stall = 0.0
    try:
        with Watchdog() as soak_dog:
            for index in range(args.jobs):
                job, run = one_job(cluster, index, args.steps, kill=(index + 1) % KILL_EVERY == 0)
                if args.keep_jobs:
                    kept.append(job)
                del job
                runs.append(run)
                print(line(run), flush=True)
    finally:
        with Watchdog() as stop_dog:
            began = time.monotonic()
            cluster.stop()
            stop_s = time.monotonic() - began
        stop_stall = stop_dog.longest
    summary = summarize(runs, args.keep_jobs, stop_s, stop_stall, soak_dog.longest)
    print(report(summary))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"summary": summary, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
