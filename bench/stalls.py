"""How long the kernel goes without running Python while jobs come and go, and where it was when it did.

Each round runs, per strategy, what ``tests/integration/test_job_queue.py``'s interrupt case does: a 600-step job,
the wait on it interrupted as Jupyter's stop button does, a 100-step job queued behind it, both waited for (the
suite's job and watchdog, ``tests/training_helpers.py``). The watchdog's thread ticks every 50 ms and records its
longest gap: the longest time no thread of the process ran Python. Each tick also re-arms
``faulthandler.dump_traceback_later``, whose own C thread needs no GIL: when the ticks stop for ``--dump-after``
seconds, every thread's Python stack is written at that moment (``--stacks``, default
``bench/results/stalls-stacks.txt``); the thread in a C call that holds the GIL is the one to read. ``--busy N``
keeps N busy-loop processes beside it (the suite's other half, a loaded CI machine).

    python bench/stalls.py [--rounds 5] [--strategies async-ps,sync-ps,allreduce] [--busy 0]
"""

from __future__ import annotations

import _thread
import argparse
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import workbench as wb

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from training_helpers import Watchdog, train  # the suite's own watchdog and job

TIMEOUT = 300.0  # seconds any one job may take
RESULTS = Path(__file__).resolve().parent / "results"


def interrupted_then_queued(cluster, strategy: str, dump_after: float, stacks) -> float:
    """One case: the longest stall from the interrupt until the queued job ended."""
    job = train(cluster, strategy=strategy, steps=600)
    deadline = time.monotonic() + TIMEOUT
    while job.steps_done < 20 and job.state == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    timer = threading.Timer(0.5, lambda: _thread.interrupt_main(signal.SIGINT))
    with Watchdog(stacks, dump_after) as dog:
        timer.start()
        try:
            job.wait(TIMEOUT)
        except KeyboardInterrupt:
            pass
        after = train(cluster, strategy=strategy, steps=100)
        after.wait(TIMEOUT)
        job.wait(TIMEOUT)
    if (job.state, after.state) != ("finished", "finished"):
        raise SystemExit(f"{strategy}: the jobs ended {job.state} and {after.state}: {job.error or after.error}")
    return dog.longest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--strategies", default="async-ps,sync-ps,allreduce")
    parser.add_argument("--busy", type=int, default=0, help="busy-loop processes beside it")
    parser.add_argument("--dump-after", type=float, default=0.3, help="seconds without a tick before stacks are written")
    parser.add_argument("--stacks", type=Path, default=RESULTS / "stalls-stacks.txt")
    args = parser.parse_args()
    args.stacks.parent.mkdir(parents=True, exist_ok=True)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    cases = []
    try:
        with open(args.stacks, "w") as stacks, wb.Cluster(ps=1, workers=2, name="wb-bench-stalls", progress=False) as cluster:
            for round_ in range(args.rounds):
                for strategy in args.strategies.split(","):
                    stacks.write(f"--- round {round_} {strategy} at {time.time():.3f}\n")
                    stacks.flush()
                    longest = interrupted_then_queued(cluster, strategy, args.dump_after, stacks)
                    cases.append({"round": round_, "strategy": strategy, "longest_stall_s": round(longest, 3)})
                    print(f"round {round_} {strategy}: longest stall {longest:.3f} s", flush=True)
    finally:
        for process in busy:
            process.kill()
            process.wait(10)
    stalls = sorted(c["longest_stall_s"] for c in cases)
    summary = {"busy": args.busy, "cases": len(cases), "max_s": stalls[-1], "median_s": stalls[len(stalls) // 2],
               "over_0_5_s": sum(s > 0.5 for s in stalls), "over_1_s": sum(s > 1.0 for s in stalls), "runs": cases}
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))
    print(f"stacks of each stall over {args.dump_after} s: {args.stacks}")
    (RESULTS / f"stalls-busy{args.busy}.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
