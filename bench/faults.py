"""What a lost or hung task costs a running job, with automatic recovery (``wb.train(..., recovery=wb.Recovery())``, the default).

For each fault, on a fresh local cluster (1 ps + 2 workers; all-reduce: 2 workers), a job trains
digits in the background; once it has run ``--warmup`` seconds and one ``--window`` more, the fault
is injected into a real process (``kill -9`` or ``SIGSTOP``), the job recovers by itself, trains
one more window, and is stopped. Reported per fault:

- recovery: seconds from the fault to the first step that used the recovered task (the re-hosted
  worker's first step; after a restore, the first step of the restored job);
- redone: steps run again after a restore (from ``job.faults``; the goal: at most one checkpoint
  interval for a ps, 0 for a worker);
- lost: steps that never ran (gaps in ``job.history``'s steps, up to the last step done 2 s before the
  job was stopped; goal 0);
- after/before: steps per second in the window from the first recovered step against the window
  before the fault (goal >= 0.95), both on the workers' clocks, from the job's own history; and the
  same for a window starting ``SETTLE`` s later (a re-hosted task's first calls trace its functions).

    python bench/faults.py [--window 8] [--json bench/results/faults.json] [--only worker-kill-async ...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from training_helpers import train

import workbench as wb
from workbench.training import strategy_named


@dataclass(frozen=True)
class Fault:
    name: str
    strategy: str
    target: str
    signal: int
    ps: int = 1
    checkpoint_every: int = 500


FAULTS = [
    Fault("worker-kill-async", "async-ps", "worker:1", signal.SIGKILL),
    Fault("worker-kill-sync", "sync-ps", "worker:1", signal.SIGKILL, checkpoint_every=100),
    Fault("worker-stop-async", "async-ps", "worker:1", signal.SIGSTOP),
    Fault("ps-kill-async", "async-ps", "ps:0", signal.SIGKILL),
    Fault("ps-kill-sync", "sync-ps", "ps:0", signal.SIGKILL, checkpoint_every=100),
    Fault("allreduce-worker-kill", "allreduce", "worker:1", signal.SIGKILL, ps=0, checkpoint_every=200),
]
HANG_TIMEOUT = 3.0  # seconds a stopped worker may answer nothing before it is replaced
SETTLE = 2.0  # the second window after recovery starts this long after the first recovered step


def _rate(history: list[dict], start: float, end: float) -> float:
    """Steps per second that ended in [start, end)."""
    return sum(start <= r["end"] < end for r in history) / (end - start)


def _wait(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {seconds} s for {what}")
        time.sleep(0.05)


def measure(fault: Fault, warmup: float, window: float) -> dict:
    with tempfile.TemporaryDirectory() as checkpoints, \
            wb.Cluster(ps=fault.ps, workers=2, name=f"wb-bench-{fault.name}", progress=False) as cluster:
        job = train(cluster, strategy=strategy_named(fault.strategy, steps_per_call=5), steps=10**7,
                    checkpoint=wb.Checkpoint(checkpoints, every=fault.checkpoint_every),
                    recovery=wb.Recovery(hang_timeout=HANG_TIMEOUT))
        _wait(lambda: job.steps_done > 0, 120, "the first step")
        time.sleep(warmup + window)
        victim = cluster.task(fault.target)
        injected = time.time()
        os.kill(victim.pid, fault.signal)
        try:
            _wait(lambda: any(f["recovered"] for f in job.faults if f["kind"] == "lost") or job.state != "running",
                  180, "the recovery")
            recovered_at = max(f["recovered"] for f in job.faults if f["kind"] == "lost")
            _wait(lambda: time.time() > recovered_at + SETTLE + window + 4, window + 60, "the windows after recovery")
        finally:
            if fault.signal == signal.SIGSTOP and cluster.task(fault.target).pid == victim.pid:
                os.kill(victim.pid, signal.SIGCONT)
            stopped = time.time()
            job.stop()
        history, faults = job.history, job.faults
        restore = next((f for f in faults if f["action"] == "restored"), None)
        if restore is not None:  # the first step of the restored job
            first = min(r["end"] for r in history if r["recovery"] == 1)
        else:  # the re-hosted worker's first step
            first = min(r["end"] for r in history if fault.target in r["worker"].split(",") and r["start"] > injected)
        # steps that never ran: gaps below the last step done 2 s before the stop (the calls in flight then may not finish)
        done = max(r["step"] for r in history if r["end"] < stopped - 2) + 1
        return {
            "fault": fault.name,
            "strategy": fault.strategy,
            "task": fault.target,
            "signal": signal.Signals(fault.signal).name,
            "recovery_s": first - injected,
            "detected_s": min(f["detected"] for f in faults if f["kind"] == "lost") - injected,
            "redone": restore["redone"] if restore else 0,
            "checkpoint_every": fault.checkpoint_every,
            "lost": done - len({r["step"] for r in history if r["step"] < done}),
            "before_steps_per_s": _rate(history, injected - window, injected),
            "after_steps_per_s": _rate(history, first, first + window),
            "settled_steps_per_s": _rate(history, first + SETTLE, first + SETTLE + window),
            "faults": faults,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=float, default=4.0, help="seconds of training before the window before the fault")
    parser.add_argument("--window", type=float, default=8.0, help="seconds of each throughput window")
    parser.add_argument("--only", nargs="*", choices=[f.name for f in FAULTS], help="run these faults only")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "faults.json")
    args = parser.parse_args()
    rows = []
    for fault in FAULTS:
        if args.only and fault.name not in args.only:
            continue
        row = measure(fault, args.warmup, args.window)
        row["ratio"] = row["after_steps_per_s"] / row["before_steps_per_s"]
        row["settled_ratio"] = row["settled_steps_per_s"] / row["before_steps_per_s"]
        rows.append(row)
        print(f"{row['fault']:22s} detected {row['detected_s']:5.1f} s  recovery {row['recovery_s']:5.1f} s  "
              f"redone {row['redone']:4d} (interval {row['checkpoint_every']})  lost {row['lost']}  "
              f"{row['before_steps_per_s']:6.1f} -> {row['after_steps_per_s']:6.1f} steps/s  after/before {row['ratio']:.2f} "
              f"({row['settled_ratio']:.2f} from {SETTLE:g} s on)",
              flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2))
    print(f"\nwritten to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
