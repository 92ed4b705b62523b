"""Start-up cost of a workbench cluster against the floor set by TensorFlow's own import.

Floor: three bare ``python -c "import tensorflow"`` processes started together (a 1 ps + 2
worker cluster hosts TensorFlow in three engines). Workbench: ``Cluster(ps=1, workers=2).start()``
until every TF server is up, the warm process's own start and import included (a cold start: no
warm process kept from an earlier cluster). Then ``scale(workers=3)``: one more worker, forked and
serving; ``stop()``; and the next start in the same process, whose engines are forks of the warm
process the stopped cluster kept. Runs alternate (floor, workbench, floor, ...) so both see the same
machine load; the figures that matter are the ratio of medians (goal <= 0.6) and the median scale
time (goal <= 1.5 s). Beside them, one ``import tensorflow`` as a kernel makes it and as the warm process and
engines make it (``lean_import``: what Keras loads only for a kernel's sake left out), and as a kernel makes it
where no bytecode is cached (``uncached``: what every Python paid before ``make install`` byte-compiled the
environment, on machines that set ``PYTHONDONTWRITEBYTECODE``), alternating: CPU seconds and peak memory of each.

    python bench/startup.py [--repeats 5] [--json bench/results/startup.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_RATIO = 0.6
GOAL_SCALE_S = 1.5


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


IMPORT_COST = """
import resource, sys, time
began = time.process_time()
if sys.argv[1] == "engine":
    from workbench.cluster.launch.lean_import import import_tensorflow
    import_tensorflow()
else:
    import tensorflow
print(time.process_time() - began, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


IMPORT_LABELS = {"kernel": "as a kernel makes it", "engine": "as an engine makes it",
                 "uncached": "with no cached bytecode"}  # the ways an import is measured, in turn


def import_cost(way: str) -> dict[str, float]:
    """CPU seconds and peak MiB of one ``import tensorflow`` in a new Python, made ``way``: "kernel", "engine", or
    "uncached" (as a kernel, with the bytecode looked for in an empty folder and none written: every module compiled)."""
    env, options = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, []
    with tempfile.TemporaryDirectory() as empty:
        if way == "uncached":
            env["PYTHONDONTWRITEBYTECODE"], options = "1", ["-X", f"pycache_prefix={empty}"]
        done = subprocess.run([sys.executable, *options, "-c", IMPORT_COST, "engine" if way == "engine" else "kernel"],
                              capture_output=True, text=True, timeout=300, env=env, check=True)
    cpu, peak = map(float, done.stdout.split())
    return {"cpu_s": cpu, "peak_mib": peak}


def workbench_seconds(**options) -> dict[str, float]:
    import workbench as wb
    from workbench.cluster.launch.fork_launcher import kept_warm

    kept_warm.release()  # a cold start, as a fresh kernel's
    started = time.perf_counter()
    cluster = wb.Cluster(ps=1, workers=2, progress=False, **options).start()
    ready = time.perf_counter() - started
    scale_started = time.perf_counter()
    cluster.scale(workers=3)
    scaled = time.perf_counter() - scale_started
    stop_started = time.perf_counter()
    cluster.stop()
    stopped = time.perf_counter() - stop_started
    next_started = time.perf_counter()
    wb.Cluster(ps=1, workers=2, progress=False, **options).start().stop()  # forks of the warm process kept at stop
    next_start = time.perf_counter() - next_started
    return {"start": ready, "scale": scaled, "stop": stopped, "next": next_start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "startup.json")
    args = parser.parse_args()
    floors, runs = [], []
    floor_seconds(1)  # warm the page cache so the first pair is not penalised
    for i in range(args.repeats):
        floors.append(floor_seconds())
        runs.append(workbench_seconds())
        print(f"run {i + 1}/{args.repeats}: floor {floors[-1]:.2f} s, workbench start {runs[-1]['start']:.2f} s, "
              f"scale +1 {runs[-1]['scale']:.2f} s, stop {runs[-1]['stop']:.2f} s, next start and stop "
              f"{runs[-1]['next']:.2f} s", flush=True)
    median = {key: statistics.median(run[key] for run in runs) for key in ("start", "scale", "stop", "next")}
    imports = {way: [] for way in IMPORT_LABELS}
    for _ in range(args.repeats):
        for way in imports:
            imports[way].append(import_cost(way))
    imported = {way: {key: statistics.median(c[key] for c in costs) for key in ("cpu_s", "peak_mib")}
                for way, costs in imports.items()}
    result = {
        "floor_median_s": statistics.median(floors),
        "workbench_start_median_s": median["start"],
        "workbench_scale_median_s": median["scale"],
        "workbench_stop_median_s": median["stop"],
        "workbench_next_start_and_stop_median_s": median["next"],
        "ratio": median["start"] / statistics.median(floors),
        "goal_ratio": GOAL_RATIO,
        "goal_scale_s": GOAL_SCALE_S,
        "import_tensorflow_median": imported,
        "floors_s": floors,
        "runs_s": runs,
        "cpus": os.cpu_count(),
    }
    print(
        f"\nthree parallel `import tensorflow` (floor): {result['floor_median_s']:.2f} s median\n"
        f"Cluster(ps=1, workers=2).start():          {median['start']:.2f} s median\n"
        f"ratio: {result['ratio']:.2f} (goal <= {GOAL_RATIO})\n"
        f"scale(workers=3), one more worker:          {median['scale']:.2f} s median (goal <= {GOAL_SCALE_S} s)\n"
        f"stop():                                     {median['stop']:.2f} s median\n"
        f"next start and stop (warm process kept):    {median['next']:.2f} s median\n"
        + "".join(f"import tensorflow {IMPORT_LABELS[way]}:  {c['cpu_s']:.2f} CPU-seconds, {c['peak_mib']:.0f} MiB "
                  "peak (medians)\n" for way, c in imported.items())
        + f"engine/kernel: {imported['engine']['cpu_s'] / imported['kernel']['cpu_s']:.2f} of the CPU, "
        f"{imported['engine']['peak_mib'] / imported['kernel']['peak_mib']:.2f} of the memory; no cached bytecode/"
        f"kernel: {imported['uncached']['cpu_s'] / imported['kernel']['cpu_s']:.2f} of the CPU"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
