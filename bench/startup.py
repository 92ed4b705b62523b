"""Start-up cost of a workbench cluster against the floor set by TensorFlow's own import.

Floor: three bare ``python -c "import tensorflow"`` processes started together (a 1 ps + 2
worker cluster imports TensorFlow in three engines). Workbench: ``Cluster(ps=1, workers=2).start()``
until every TF server is up. Runs alternate (floor, workbench, floor, ...) so both see the same
machine load; the figure that matters is the ratio of medians. Goal: ratio <= 1.25.

    python bench/startup.py [--repeats 5] [--json bench/results/startup.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def floor_seconds(processes: int = 3) -> float:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    started = time.perf_counter()
    procs = [
        subprocess.Popen([sys.executable, "-c", "import tensorflow"], env=env, stderr=subprocess.DEVNULL)
        for _ in range(processes)
    ]
    for proc in procs:
        if proc.wait(timeout=300) != 0:
            raise RuntimeError("import tensorflow failed")
    return time.perf_counter() - started


def workbench_seconds() -> tuple[float, float]:
    import workbench as wb

    started = time.perf_counter()
    cluster = wb.Cluster(ps=1, workers=2, progress=False).start()
    ready = time.perf_counter() - started
    stop_started = time.perf_counter()
    cluster.stop()
    return ready, time.perf_counter() - stop_started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "startup.json")
    args = parser.parse_args()
    floors, starts, stops = [], [], []
    floor_seconds(1)  # warm the page cache so the first pair is not penalised
    for i in range(args.repeats):
        floors.append(floor_seconds())
        ready, stopped = workbench_seconds()
        starts.append(ready)
        stops.append(stopped)
        print(f"run {i + 1}/{args.repeats}: floor {floors[-1]:.2f} s, workbench start {ready:.2f} s, stop {stopped:.2f} s",
              flush=True)
    result = {
        "floor_median_s": statistics.median(floors),
        "workbench_start_median_s": statistics.median(starts),
        "workbench_stop_median_s": statistics.median(stops),
        "ratio": statistics.median(starts) / statistics.median(floors),
        "goal_ratio": 1.25,
        "floors_s": floors,
        "starts_s": starts,
        "stops_s": stops,
        "cpus": os.cpu_count(),
    }
    print(
        f"\nthree parallel `import tensorflow` (floor): {result['floor_median_s']:.2f} s median\n"
        f"Cluster(ps=1, workers=2).start():          {result['workbench_start_median_s']:.2f} s median\n"
        f"ratio: {result['ratio']:.2f} (goal <= 1.25); stop(): {result['workbench_stop_median_s']:.2f} s median"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
