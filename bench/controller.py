"""ipyparallel's controller with its schedulers in threads (the workbench's default) against processes.

``IPController.use_threads=True`` runs the task, mux, control, iopub and broadcast schedulers as
threads of the hub process instead of one process each. For each setting, alternating, on a 1 ps +
2 worker cluster:

- memory: the summed PSS of the controller's processes once the cluster is up;
- messaging: round trips per second of a tiny ``apply`` to all three engines (what a busy
  interactive session and the workbench's control calls cost);
- training: async-ps steps per second after warm-up (the workbench's own traffic through the
  controller: one call per ``steps_per_call`` steps per worker).

    python bench/controller.py [--repeats 3] [--json bench/results/controller.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import psutil

SETTINGS = {"threads": [], "processes": ["--IPController.use_threads=False"]}


def _noop() -> int:
    return 0


def controller_pss(cluster) -> int:
    roots = [p for p in psutil.Process().children() if "ipyparallel.controller" in " ".join(p.cmdline())]
    total = 0
    for root in roots:
        for process in (root, *root.children(recursive=True)):
            try:
                total += process.memory_full_info().pss
            except psutil.Error:
                pass
    return total


def round_trips(cluster, seconds: float = 3.0) -> float:
    view = cluster.client[:]
    view.apply_sync(_noop)  # warm up
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        view.apply_sync(_noop)
        done += 1
    return done / (time.perf_counter() - started)


def training_rate(cluster) -> float:
    import keras

    import workbench as wb

    def make_model():
        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                                 keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])

    job = wb.train(cluster, make_model, wb.datasets.digits, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   strategy="async-ps", steps=1200, batch_size=64, seed=0, telemetry=False).wait()
    return job.throughput(warmup=200)["steps_per_s"]


def measure(setting: str) -> dict:
    import workbench as wb

    with wb.Cluster(ps=1, workers=2, progress=False, controller_args=SETTINGS[setting]) as cluster:
        time.sleep(1.0)  # let the controller settle
        return {"pss_mib": controller_pss(cluster) / 2**20, "round_trips_per_s": round_trips(cluster),
                "steps_per_s": training_rate(cluster)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "controller.json")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for i in range(args.repeats):
        for name in SETTINGS:
            runs[name].append(measure(name))
            r = runs[name][-1]
            print(f"run {i + 1}/{args.repeats} {name:9s}: controller {r['pss_mib']:5.0f} MiB PSS, "
                  f"{r['round_trips_per_s']:6.0f} round trips/s, {r['steps_per_s']:6.1f} async-ps steps/s", flush=True)
    medians = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()}
    t, p = medians["threads"], medians["processes"]
    print(f"\ncontroller memory:  threads {t['pss_mib']:.0f} MiB, processes {p['pss_mib']:.0f} MiB "
          f"({p['pss_mib'] - t['pss_mib']:.0f} MiB saved)\n"
          f"round trips/s:      threads {t['round_trips_per_s']:.0f}, processes {p['round_trips_per_s']:.0f} "
          f"(ratio {t['round_trips_per_s'] / p['round_trips_per_s']:.2f})\n"
          f"async-ps steps/s:   threads {t['steps_per_s']:.1f}, processes {p['steps_per_s']:.1f} "
          f"(ratio {t['steps_per_s'] / p['steps_per_s']:.2f})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"runs": runs, "medians": medians}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
