"""Network what-if: what the link emulator holds, and what reduced-precision transfer buys on a slow link.

Two parts, one run (``python bench/network.py``, or ``make bench-network``):

* ``backends``: the user-space relay (``workbench/cluster/relay.py``) set to each rate, a sender process
  pushing as fast as it can through it for a few seconds: the rate held in steady state (relative to
  the setting), the relay's CPU use, and the highest rate it carries unshaped. A rate is claimed when
  it is held within 10%.
* ``precision``: 1 ps + 2 workers behind 1 Gbit/s links (``network="1gbit"``), async-ps, an MLP big
  enough to be link-bound (64-1024-1024-10, 4.5 MB of float32 parameters), per-worker batch 32:
  steps/s in steady state and test accuracy with ``transfer="fp32"``, ``"bf16"`` and ``"int8"``,
  runs alternating, medians of the repeats. Also how busy the ps's link was in each direction
  (bytes through it / (rate x time)): a worker reads, then pushes, so each direction idles while
  the other works (``fp32-serial``: reads not overlapped with pushes).
* ``cost``: ``wb.estimate`` (profiled once per transfer and batch, unshaped) against measured steps/s,
  for fp32 and bf16, global batch 64 and 512, links of 1 and 10 Gbit/s.

Results go to ``bench/results/network.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training import completion_points, finished, steady_rate

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
RATES = ("100mbit", "1gbit", "2gbit", "4gbit", "10gbit")
LINK = "1gbit"
HIDDEN = 1024
SEND_SECONDS = 4.0
SKIP_SECONDS = 1.0  # the start of a transfer (buffers filling) is left out

SENDER = """
import socket, sys, time
sys.stdin.readline()  # the relay knows this process from here on
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
chunk, until = b"x" * (1 << 20), time.monotonic() + float(sys.argv[2])
while time.monotonic() < until:
    sock.sendall(chunk)
sock.close()
"""


class Counter:
    """A server counting what it receives, with timestamps."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.samples: list[tuple[float, int]] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        self.server.settimeout(30)
        connection, _ = self.server.accept()
        total = 0
        with connection:
            while data := connection.recv(1 << 20):
                total += len(data)
                self.samples.append((time.monotonic(), total))

    def steady_bits(self, began: float) -> float:
        window = [s for s in self.samples if s[0] >= began + SKIP_SECONDS]
        (t0, b0), (t1, b1) = window[0], window[-1]
        return (b1 - b0) * 8 / (t1 - t0)


def relay_at(links, rate: str | None, sender_pid: int) -> None:
    """The sender is worker:0, the sink ps:0; both links at ``rate`` (planned as ``cluster.shape`` plans)."""
    from workbench.cluster.shaping import Rule, Shaping, parse_rate

    links.processes({sender_pid: "worker:0"})
    shaping = Shaping([Rule("all", parse_rate(rate), 0.0)] if rate else [])
    links.apply(*shaping.plan(["ps:0", "worker:0"]))


def measure_rate(rate: str | None) -> dict:
    from workbench.cluster.shaping import UserSpaceLinks, parse_rate

    links = UserSpaceLinks()
    try:
        sink = Counter()
        port = links.listen("ps:0", f"127.0.0.1:{sink.port}")
        sender = subprocess.Popen([sys.executable, "-c", SENDER, str(port), str(SEND_SECONDS)], stdin=subprocess.PIPE)
        relay_at(links, rate, sender.pid)
        began, cpu_before = time.monotonic(), links.stats()["cpu_seconds"]
        sender.stdin.close()  # go
        sender.wait(SEND_SECONDS + 30)
        cpu = links.stats()["cpu_seconds"] - cpu_before
        sink.thread.join(10)
        held = sink.steady_bits(began)
    finally:
        links.close()
    setting = parse_rate(rate) if rate else None
    return {"rate": rate or "unshaped", "held_gbit": held / 1e9, "relative": held / setting if setting else None,
            "relay_cpu_fraction": cpu / (time.monotonic() - began)}


def backends(repeats: int) -> dict:
    rows = []
    for rate in (*RATES, None):
        runs = [measure_rate(rate) for _ in range(repeats)]
        row = dict(runs[0])
        row["held_gbit"] = statistics.median(r["held_gbit"] for r in runs)
        row["relative"] = statistics.median(r["relative"] for r in runs) if rate else None
        row["relay_cpu_fraction"] = statistics.median(r["relay_cpu_fraction"] for r in runs)
        row["repeats"] = [round(r["held_gbit"], 3) for r in runs]
        rows.append(row)
        print(f"  relay {row['rate']:>9}: held {row['held_gbit']:.3f} Gbit/s"
              + (f" ({row['relative']:.3f} of the setting)" if rate else "")
              + f", relay CPU {row['relay_cpu_fraction'] * 100:.0f}% of a core", flush=True)
    claimed = [r["rate"] for r in rows if r["relative"] and abs(r["relative"] - 1) <= 0.10]
    return {"rows": rows, "claimed": claimed, "unshaped_gbit": rows[-1]["held_gbit"]}


def wide_model():
    import keras

    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(HIDDEN, activation="relu"),
                             keras.layers.Dense(HIDDEN, activation="relu"), keras.layers.Dense(10)])


def wide_job(cluster, transfer: str, batch: int, steps: int, metrics: tuple = ()):
    """A finished digits job of the wide model (what a user would run): Adam 1e-3, seed 0."""
    import keras

    import workbench as wb

    return finished(wb.train(cluster, wide_model, wb.datasets.digits,
                             keras.losses.SparseCategoricalCrossentropy(from_logits=True), keras.optimizers.Adam(1e-3),
                             steps=steps, batch_size=batch, seed=0, transfer=transfer, metrics=metrics,
                             telemetry=False))


def precision_run(cluster, transfer: str, steps: int, overlap: bool = True) -> dict:
    import workbench as wb

    os.environ["WORKBENCH_OVERLAP_TRANSFERS"] = "1" if overlap else "0"  # read when the job starts
    before = cluster.link_stats()
    job = wide_job(cluster, transfer, 64, steps, metrics=("accuracy",))
    after = cluster.link_stats()
    history = job.history
    rate = steady_rate(completion_points(history))
    seconds = after["seconds"] - before["seconds"]
    link_bytes = 1e9 / 8 * seconds
    moved = {d: after["sent"].get(f"ps:0 {d}", 0) - before["sent"].get(f"ps:0 {d}", 0) for d in ("out", "in")}
    use = {d: moved[d] / link_bytes for d in ("out", "in")}  # over the whole job, its start-up included
    # in steady state: the bytes a step moved through the ps's link (counted by the relay) at the steady rate
    steady_use = {d: moved[d] / len(history) * rate / (1e9 / 8) for d in ("out", "in")}
    accuracy = job.evaluate(wb.datasets.digits_test)["accuracy"]
    return {"steps_per_s": rate, "accuracy": accuracy, "bytes_per_step": job.info["bytes_per_step"]["total"],
            "ps_link_use": use, "ps_link_use_steady": steady_use}


def precision(repeats: int, steps: int) -> dict:
    import workbench as wb

    settings = ("fp32-serial", "fp32", "bf16", "int8")  # fp32-serial: reads do not overlap pushes
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    with wb.Cluster(ps=1, workers=2, network=LINK, progress=False) as cluster:
        precision_run(cluster, "fp32", 40)  # warm-up: functions, channels, the relay's connections
        for _ in range(repeats):
            for setting in settings:
                run = precision_run(cluster, setting.split("-")[0], steps, overlap=not setting.endswith("serial"))
                runs[setting].append(run)
                print(f"  {setting}: {run['steps_per_s']:.1f} steps/s, accuracy {run['accuracy']:.3f}, "
                      f"{run['bytes_per_step'] / 1e6:.2f} MB/step, ps link use in steady state out "
                      f"{run['ps_link_use_steady']['out']:.2f} in {run['ps_link_use_steady']['in']:.2f} (whole job "
                      f"{run['ps_link_use']['out']:.2f}, {run['ps_link_use']['in']:.2f})", flush=True)
    summary = {}
    for setting, rs in runs.items():
        summary[setting] = {
            "steps_per_s": statistics.median(r["steps_per_s"] for r in rs),
            "accuracy": statistics.median(r["accuracy"] for r in rs),
            "bytes_per_step": rs[0]["bytes_per_step"],
            "ps_link_use_out": statistics.median(r["ps_link_use"]["out"] for r in rs),
            "ps_link_use_in": statistics.median(r["ps_link_use"]["in"] for r in rs),
            "ps_link_use_steady_out": statistics.median(r["ps_link_use_steady"]["out"] for r in rs),
            "ps_link_use_steady_in": statistics.median(r["ps_link_use_steady"]["in"] for r in rs),
            "repeats": [round(r["steps_per_s"], 2) for r in rs],
        }
    fp32 = summary["fp32"]
    ratios = {s: {"speed": summary[s]["steps_per_s"] / fp32["steps_per_s"],
                  "accuracy_points": 100 * (summary[s]["accuracy"] - fp32["accuracy"]),
                  "per_repeat": [round(a["steps_per_s"] / b["steps_per_s"], 3) for a, b in zip(runs[s], runs["fp32"])]}
              for s in ("bf16", "int8")}
    ratios["fp32"] = {"speed": fp32["steps_per_s"] / summary["fp32-serial"]["steps_per_s"],
                      "accuracy_points": 100 * (fp32["accuracy"] - summary["fp32-serial"]["accuracy"]),
                      "per_repeat": [round(a["steps_per_s"] / b["steps_per_s"], 3)
                                     for a, b in zip(runs["fp32"], runs["fp32-serial"])]}
    return {"link": LINK, "hidden": HIDDEN, "steps": steps, "lines": summary, "ratios": ratios}


def measured_rate(cluster, transfer: str, batch: int, steps: int) -> float:
    """Steady-state steps/s of the wide model's digits job."""
    return steady_rate(completion_points(wide_job(cluster, transfer, batch, steps).history))


def cost_model(steps: int) -> dict:
    """``wb.estimate`` against measurement: transfer x global batch x link, 1 ps + 2 workers, async-ps."""
    import workbench as wb

    rows = []
    os.environ["WORKBENCH_OVERLAP_TRANSFERS"] = "1"
    with wb.Cluster(ps=1, workers=2, network="auto", progress=False) as cluster:
        measured_rate(cluster, "fp32", 64, 40)  # warm-up
        for transfer in ("fp32", "bf16"):
            for batch in (64, 512):
                cluster.shape(None)
                profile = wb.estimate(wide_model, cluster, batch, transfer=transfer).profile
                for link in ("1gbit", "10gbit"):
                    predicted = wb.estimate(wide_model, cluster, batch, transfer=transfer, link=link, profile=profile)
                    cluster.shape(link)
                    measured = measured_rate(cluster, transfer, batch, steps)
                    rows.append({"transfer": transfer, "batch": batch, "link": link, "predicted": predicted.steps_per_s,
                                 "measured": measured, "error": measured / predicted.steps_per_s - 1,
                                 "bottleneck": predicted.bottleneck})
                    print(f"  {transfer} batch {batch:>3} {link:>6}: predicted {predicted.steps_per_s:6.1f} steps/s "
                          f"({predicted.bottleneck}), measured {measured:6.1f}: {rows[-1]['error']:+.0%}", flush=True)
    return {"rows": rows, "worst": max(abs(r["error"]) for r in rows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("backends", "precision", "cost", "all"), default="all")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    results: dict = {}
    if args.part in ("backends", "all"):
        print("user-space relay, a sender process through it:", flush=True)
        results["backends"] = backends(args.repeats)
    if args.part in ("precision", "all"):
        print(f"async-ps, 1 ps + 2 workers behind {LINK} links, MLP 64-{HIDDEN}-{HIDDEN}-10:", flush=True)
        results["precision"] = precision(args.repeats, args.steps)
        for setting, ratio in results["precision"]["ratios"].items():
            base = "fp32-serial" if setting == "fp32" else "fp32"
            goal = {"bf16": " (goal >= 1.8, accuracy within 1 point)", "fp32": " (overlap)"}.get(setting, "")
            print(f"{setting} / {base}: {ratio['speed']:.2f}x steps/s{goal}, accuracy "
                  f"{ratio['accuracy_points']:+.1f} points; per repeat {ratio['per_repeat']}")
    if args.part in ("cost", "all"):
        print("wb.estimate against measurement (async-ps, 1 ps + 2 workers, the same wide MLP):", flush=True)
        results["cost_model"] = cost_model(args.steps)
        print(f"cost model: worst error {results['cost_model']['worst']:.0%} (goal: within 20%)")
    if "backends" in results:
        print(f"relay rates held within 10%: {', '.join(results['backends']['claimed'])}; unshaped "
              f"{results['backends']['unshaped_gbit']:.1f} Gbit/s")
    out = Path(__file__).resolve().parent / "results" / "network.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
