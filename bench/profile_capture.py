"""Profile capture costs: steps/s of a running job during a capture against outside it, and parse time.

    python bench/profile_capture.py          (starts its own 1 ps + 2 worker cluster)

``bench/dashboard.py`` calls these functions too.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _rate(history: list[dict], start: float, end: float) -> float:
    """Steps per second that ended inside [start, end) (worker-side end times; one machine, one clock)."""
    return sum(1 for r in history if start <= r["end"] < end) / (end - start)


def measure_capture_slowdown(cluster, seconds: float = 2.0, repeats: int = 3) -> dict:
    """An async-ps job runs; each repeat takes ``seconds`` before, during, and after a capture."""
    import keras

    import workbench as wb

    def make_model():
        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                                 keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])

    job = wb.train(cluster, make_model, wb.datasets.digits, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   steps=10**7, batch_size=64, seed=0, telemetry=False)
    runs, events = [], []
    try:
        deadline = time.monotonic() + 120
        while job.steps_done < 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        cluster.profile(seconds=0.5)  # profiler services started and warmed up outside the measurement
        for _ in range(repeats):
            before = time.time()
            time.sleep(seconds)
            started = time.time()
            profile = cluster.profile(seconds=seconds)
            finished = time.time()
            time.sleep(seconds)
            after = time.time()
            capture_start = min(e.start for e in profile.events)
            capture_end = capture_start + seconds
            history = job.history
            outside = (_rate(history, before, started) + _rate(history, finished, after)) / 2
            runs.append({"outside": outside, "during": _rate(history, capture_start, capture_end),
                         "call_seconds": finished - started})
            events.append(len(profile.events))
    finally:
        job.stop()
    real_parse = measure_real_parse(profile)
    links = measure_links(profile)
    median = sorted(runs, key=lambda r: r["during"] / r["outside"])[len(runs) // 2]
    return {"steps_per_s_outside": median["outside"], "steps_per_s_during": median["during"],
            "ratio_during_over_outside": median["during"] / median["outside"], "capture_call_seconds": median["call_seconds"],
            "ops_per_capture": events, "real_capture_parse": real_parse, "links": links, "runs": runs}


def measure_links(profile) -> dict:
    """Of a real capture: Sends between devices, how many were linked, the Send->receiver delays, and why the rest were not."""
    import statistics

    delays_ms = sorted(1000 * (receiver.start - send.start) for send, receiver in profile.transfers)
    unlinked = profile.unlinked()
    return {"sends": len(profile.transfers) + sum(unlinked.values()), "linked": len(profile.transfers),
            "delay_ms_median": statistics.median(delays_ms) if delays_ms else None,
            "delay_ms_p95": delays_ms[int(0.95 * (len(delays_ms) - 1))] if delays_ms else None,
            "delay_ms_max": delays_ms[-1] if delays_ms else None, "unlinked": unlinked}


def measure_real_parse(profile) -> dict:
    """Parse time of a real capture's files (TensorFlow already imported: the parse alone)."""
    from pathlib import Path

    from workbench.telemetry.trace import parse_xspace

    files = list(Path(profile.logdir).glob("plugins/profile/*/*.xplane.pb"))
    started = time.perf_counter()
    ops = sum(len(parse_xspace(path, "task", "/job:task/replica:0/task:0")) for path in files)
    return {"files": len(files), "ops": ops, "parse_seconds": time.perf_counter() - started}


def measure_parse(n_events: int = 100_000) -> dict:
    """Parse time per 100,000 op events: a synthetic XSpace of ``n_events`` TF ops on 8 threads."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    from workbench.telemetry.trace import parse_xspace

    space = xplane_pb2.XSpace()
    env = space.planes.add(name="Task Environment")
    env.stat_metadata[1].name = "profile_start_time"
    stat = env.stats.add(metadata_id=1)
    stat.int64_value = time.time_ns()
    plane = space.planes.add(name="/host:CPU")
    for i, name in enumerate(["dense/MatMul:MatMul", "dense/BiasAdd:BiasAdd", "relu:Relu", "read/_1:_Send"], start=1):
        plane.event_metadata[i].name = name
    plane.stat_metadata[1].name = "key"
    plane.stat_metadata[2].name = "to"
    per_line = n_events // 8
    for t in range(8):
        line = plane.lines.add(id=t, name=f"tf_Compute/{t}", timestamp_ns=1000)
        for i in range(per_line):
            event = line.events.add(metadata_id=1 + i % 4, offset_ps=i * 10_000_000, duration_ps=5_000_000)
            if i % 4 == 3:
                key = event.stats.add(metadata_id=1)
                key.str_value = "/job:ps/replica:0/task:0/device:CPU:0;1;/job:worker/replica:0/task:0/device:CPU:0;edge;0:0"
                to = event.stats.add(metadata_id=2)
                to.str_value = "dense/MatMul"
    data = space.SerializeToString()
    started = time.perf_counter()
    events = parse_xspace(data, "ps:0", "/job:ps/replica:0/task:0")
    seconds = time.perf_counter() - started
    return {"events": len(events), "parse_seconds": seconds, "seconds_per_100k_events": seconds * 100_000 / len(events)}


def main() -> int:
    import workbench as wb

    results = {"parse": measure_parse()}
    print("parse:", json.dumps(results["parse"]), flush=True)
    with wb.Cluster(ps=1, workers=2, progress=False) as cluster:
        results["capture"] = measure_capture_slowdown(cluster)
    print("capture:", json.dumps({k: v for k, v in results["capture"].items() if k != "runs"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
