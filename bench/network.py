"""Network what-if: what the link emulators hold, and what reduced-precision transfer buys on a slow link.

Three parts, one run (``python bench/network.py``, or ``make bench-network``):

* ``backends``: each backend that runs here (``netns``: namespaces, veth and tc, as root; ``user``: the
  relay of ``workbench/cluster/network/relay.py``) set to each rate, a sender process pushing as fast as it can
  to a receiver through it for a few seconds: the payload rate the receiver got in steady state
  (relative to the setting), the relay's own CPU, the machine's busy cores, and the highest rate
  carried unshaped. A rate is claimed when it is held within 10%. tc counts the wire (TCP/IP headers
  of 1500-byte frames included), so its payload is about 4% under the setting, as on real Ethernet.
* ``precision``: 1 ps + 2 workers behind 1 Gbit/s links (``network=dict(backend=..., rate="1gbit")``),
  async-ps, an MLP big enough to be link-bound (64-1024-1024-10, 4.5 MB of float32 parameters),
  per-worker batch 32: steps/s in steady state and test accuracy with ``transfer="fp32"``, ``"bf16"``
  and ``"int8"``, runs alternating, medians of the repeats. Also how busy the ps's link was in each
  direction (bytes through it / (rate x time)): a worker reads, then pushes, so each direction idles
  while the other works (``fp32-serial``: reads not overlapped with pushes). For overlapped fp32, how far apart
  the two workers' parameter arrivals are (``arrival_offsets``): whether they read in step. For the fp32 lines, a
  worker's median cycle across the end of a remote call and within one (``call_boundaries``): what a call's end
  costs. ``--long-calls K`` adds ``fp32-long``, overlapped fp32 with K steps per call instead of 10. A second,
  independent formula beside the links' counts (``host_clock``): steps over the host clock from the end of each
  worker's first call to the job's last step, against the parameters' bytes once each way per step over the rate.
  ``--mtu 9000`` runs it on netns links of jumbo frames: a frame's TCP/IP and Ethernet headers are then under 1 %
  of the wire's bytes instead of about 4.5 %.
* ``cost``: ``wb.estimate`` (profiled once per transfer and batch, unshaped, as a user would call it)
  against measured steps/s, for fp32 and bf16, global batch 64 and 512, links of 1 and 10 Gbit/s: each
  point measured ``--repeats`` times, the links alternating, and the median compared. Goal: within 15%
  on every point.
* ``convergence``: does int8 converge where fp32 does? 1 ps + 3 workers behind 1 Gbit/s links, async-ps, the
  wide MLP, per-worker batch 32, ``--steps`` steps, seeds 0-4 (``--seeds``), fp32 then int8 for each seed: test
  accuracy per run. Goal: every int8 run within 0.02 of fp32's median accuracy or above it (a 300-step run of
  fp32 itself spreads by several points between seeds, so one seed's pair is no comparison).

Results go to ``bench/results/network.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training import completion_points, finished, steady_rate

import workbench as wb

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
RATES = ("100mbit", "1gbit", "2gbit", "4gbit", "10gbit")
LINK = "1gbit"
HIDDEN = 1024
SEND_SECONDS = 4.0
SKIP_SECONDS = 1.0  # the start of a transfer (buffers filling) is left out
DEFAULT_STEPS_PER_CALL = wb.AsyncPS().steps_per_call  # what a user's job runs unless told otherwise

SENDER = """
import socket, sys, time
sys.stdin.readline()  # the links know this process from here on
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
chunk, until = b"x" * (1 << 20), time.monotonic() + float(sys.argv[3])
while time.monotonic() < until:
    sock.sendall(chunk)
sock.close()
"""

SINK = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
server.settimeout(30)
connection, _ = server.accept()
samples, total = [], 0
while data := connection.recv(1 << 20):
    total += len(data)
    samples.append((time.monotonic(), total))
window = [s for s in samples if s[0] >= samples[0][0] + float(sys.argv[2])]
print((window[-1][1] - window[0][1]) * 8 / (window[-1][0] - window[0][0]), flush=True)
"""


def machine_busy() -> tuple[float, float]:
    """(busy, all) CPU seconds of the whole machine so far, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle and iowait
    return (sum(fields) - idle) / tick, sum(fields) / tick


def plan_at(rate: str | None):
    """Both tasks' links at ``rate``, planned as ``cluster.shape`` plans them."""
    from workbench.cluster.network.shaping import Rule, Shaping, parse_rate

    return Shaping([Rule("all", parse_rate(rate), 0.0)] if rate else []).plan(["ps:0", "worker:0"])


def measure_rate(backend: str, rate: str | None) -> dict:
    """A sender (worker:0) pushing as fast as it can to a sink (ps:0) through links of ``backend`` at ``rate``."""
    from workbench.cluster.network.netns import NamespaceLinks
    from workbench.cluster.network.shaping import UserSpaceLinks, parse_rate

    links = NamespaceLinks() if backend == "netns" else UserSpaceLinks()
    try:
        if backend == "netns":
            ps, worker = links.attach("ps:0"), links.attach("worker:0")
            inside = {"ps": ["nsenter", f"--net={ps.namespace.path}"], "worker": ["nsenter", f"--net={worker.namespace.path}"]}
            sink_host = ps.address
        else:
            inside, sink_host = {"ps": [], "worker": []}, "127.0.0.1"
        sink = subprocess.Popen([*inside["ps"], sys.executable, "-c", SINK, sink_host, str(SKIP_SECONDS)],
                                stdout=subprocess.PIPE, text=True)
        sink_port = int(sink.stdout.readline())
        target = (sink_host, sink_port) if backend == "netns" else ("127.0.0.1", links.listen("ps:0", f"127.0.0.1:{sink_port}"))
        sender = subprocess.Popen([*inside["worker"], sys.executable, "-c", SENDER, target[0], str(target[1]),
                                   str(SEND_SECONDS)], stdin=subprocess.PIPE)
        if backend == "user":
            links.processes({sender.pid: "worker:0"})
        links.apply(*plan_at(rate))
        began, cpu_before, busy_before = time.monotonic(), links.stats()["cpu_seconds"], machine_busy()
        sender.stdin.close()  # go
        sender.wait(SEND_SECONDS + 30)
        elapsed, busy_after = time.monotonic() - began, machine_busy()
        cpu = links.stats()["cpu_seconds"] - cpu_before
        held = float(sink.communicate(timeout=30)[0])
    finally:
        links.close()
    setting = parse_rate(rate) if rate else None
    return {"rate": rate or "unshaped", "held_gbit": held / 1e9, "relative": held / setting if setting else None,
            "emulator_cpu_fraction": cpu / elapsed, "machine_cores_busy": (busy_after[0] - busy_before[0]) / elapsed}


def backends(repeats: int) -> dict:
    """Each backend that runs here, at each rate: what it holds and what it costs."""
    from workbench.cluster.network import netns

    found = {}
    for backend in ("netns", "user"):
        if backend == "netns" and netns.problem():
            print(f"  netns: not measured: {netns.problem()}", flush=True)
            continue
        rows = []
        for rate in (*RATES, None):
            runs = [measure_rate(backend, rate) for _ in range(repeats)]
            row = dict(runs[0])
            for key in ("held_gbit", "relative", "emulator_cpu_fraction", "machine_cores_busy"):
                row[key] = statistics.median(r[key] for r in runs) if runs[0][key] is not None else None
            row["repeats"] = [round(r["held_gbit"], 3) for r in runs]
            rows.append(row)
            print(f"  {backend} {row['rate']:>9}: held {row['held_gbit']:.3f} Gbit/s"
                  + (f" ({row['relative']:.3f} of the setting)" if rate else "")
                  + (f", relay CPU {row['emulator_cpu_fraction'] * 100:.0f}% of a core" if backend == "user" else "")
                  + f", machine {row['machine_cores_busy']:.2f} cores busy", flush=True)
        claimed = [r["rate"] for r in rows if r["relative"] and abs(r["relative"] - 1) <= 0.10]
        found[backend] = {"rows": rows, "claimed": claimed, "unshaped_gbit": rows[-1]["held_gbit"]}
    return found


def wide_model():
    import keras

    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(HIDDEN, activation="relu"),
                             keras.layers.Dense(HIDDEN, activation="relu"), keras.layers.Dense(10)])


def wide_job(cluster, transfer: str, batch: int, steps: int, metrics: tuple = (), seed: int = 0,
             steps_per_call: int = DEFAULT_STEPS_PER_CALL, overlap: bool = True):
    """A finished digits job of the wide model (what a user would run): Adam 1e-3, the workbench's default
    ``steps_per_call`` unless given."""
    import keras

    import workbench as wb

    return finished(wb.train(cluster, wide_model, wb.datasets.digits,
                             keras.losses.SparseCategoricalCrossentropy(from_logits=True), keras.optimizers.Adam(1e-3),
                             strategy=wb.AsyncPS(transfer=transfer, steps_per_call=steps_per_call, overlap=overlap), steps=steps,
                             batch_size=batch, seed=seed, metrics=metrics, telemetry=False))


def convergence(seeds: int, steps: int, backend: str) -> dict:
    """fp32 and int8 test accuracy per seed, 1 ps + 3 workers behind 1 Gbit/s links (see the module docstring)."""
    import workbench as wb

    workers, accuracy = 3, {"fp32": [], "int8": []}
    with wb.Cluster(ps=1, workers=workers, network=dict(backend=backend, rate=LINK), progress=False) as cluster:
        for seed in range(seeds):
            for transfer in accuracy:
                job = wide_job(cluster, transfer, 32 * workers, steps, metrics=("accuracy",), seed=seed)
                accuracy[transfer].append(job.evaluate(wb.datasets.digits_test)["accuracy"])
                print(f"  seed {seed} {transfer}: test accuracy {accuracy[transfer][-1]:.3f}", flush=True)
    reference = statistics.median(accuracy["fp32"])
    converged = [a >= reference - 0.02 for a in accuracy["int8"]]
    return {"workers": workers, "steps": steps, "accuracy": accuracy, "fp32_median": reference,
            "int8_median": statistics.median(accuracy["int8"]), "int8_converged": sum(converged), "seeds": seeds}


def by_worker(history: list[dict]) -> dict[str, list[dict]]:
    """A job's step records per worker, each worker's in step order."""
    grouped: dict[str, list[dict]] = {}
    for record in sorted(history, key=lambda r: r["step"]):
        grouped.setdefault(record["worker"], []).append(record)
    return grouped


def steady_part(records: list) -> list:
    """The steady state of one worker's steps: 20%-90% of them."""
    return records[len(records) // 5: len(records) * 9 // 10]


def arrival_offsets(history: list[dict]) -> dict:
    """Do the workers read in step? For each arrival of the first worker's parameters (a step's ``start``) in steady
    state (20%-90% of its steps), the time to the second worker's nearest arrival; and the first's median cycle.
    In step, the offsets would sit near 0 and the card would idle through every compute."""
    workers = by_worker(history)
    if len(workers) < 2:
        return {}
    first, second = (sorted(r["start"] for r in workers[name]) for name in sorted(workers)[:2])
    steady = steady_part(first)
    offsets = sorted(min(abs(t - u) for u in second) for t in steady)
    cycles = [b - a for a, b in zip(steady, steady[1:])]
    at = lambda q: 1e3 * offsets[min(len(offsets) - 1, int(q * len(offsets)))]  # noqa: E731
    return {"cycle_ms": 1e3 * statistics.median(cycles), "offset_ms_p10": at(0.1), "offset_ms_p50": at(0.5),
            "offset_ms_p90": at(0.9)}


def call_boundaries(history: list[dict]) -> dict:
    """What a remote call's end costs a worker: its median cycle (one of its steps' start to its next one's) across
    the end of a call (its steps are consecutive within a call, and the next call's are another chunk) and within a
    call, in steady state (20%-90% of its steps), over the workers."""
    across, within = [], []
    for records in by_worker(history).values():
        steady = steady_part(records)
        for a, b in zip(steady, steady[1:]):
            (within if b["step"] == a["step"] + 1 else across).append(b["start"] - a["start"])
    if not across or not within:
        return {}
    return {"across_ms": 1e3 * statistics.median(across), "within_ms": 1e3 * statistics.median(within)}


def host_clock_use(history: list[dict], parameter_bytes: int, workers: int, steps_per_call: int) -> dict:
    """The second, independent link-use formula: steps over the host clock (every task runs on this machine) from the
    end of the warm-up (each worker's first call) to the job's last step, calls' ends and the tail included, against
    the bound of the parameters' bytes once each way per step over the link's rate (no header or framing counted)."""
    ends = sorted(record["end"] for record in history)
    warm = workers * steps_per_call
    if len(ends) <= warm + 1:
        return {}
    rate = (len(ends) - warm) / (ends[-1] - ends[warm - 1])
    bound = (1e9 / 8) / parameter_bytes
    return {"steps_per_s": rate, "bound_steps_per_s": bound, "use": rate / bound}


def precision_run(cluster, transfer: str, steps: int, overlap: bool = True,
                  steps_per_call: int = DEFAULT_STEPS_PER_CALL) -> dict:
    import workbench as wb

    before, busy_before = cluster.link_stats(), machine_busy()
    workers = sum(1 for task in cluster.tasks if task.job == "worker")
    job = wide_job(cluster, transfer, 32 * workers, steps, metrics=("accuracy",), steps_per_call=steps_per_call,
                   overlap=overlap)  # 32 per worker
    after, busy_after = cluster.link_stats(), machine_busy()
    history = job.history
    rate = steady_rate(completion_points(history))
    seconds = after["seconds"] - before["seconds"]
    link_bytes = 1e9 / 8 * seconds
    moved = {d: after["sent"].get(f"ps:0 {d}", 0) - before["sent"].get(f"ps:0 {d}", 0) for d in ("out", "in")}
    use = {d: moved[d] / link_bytes for d in ("out", "in")}  # over the whole job, its start-up included
    # in steady state: the bytes a step moved through the ps's link (counted by the links) at the steady rate
    steady_use = {d: moved[d] / len(history) * rate / (1e9 / 8) for d in ("out", "in")}
    accuracy = job.evaluate(wb.datasets.digits_test)["accuracy"]
    host = host_clock_use(history, job.info["bytes_per_step"]["parameters"], workers, steps_per_call)
    return {"steps_per_s": rate, "accuracy": accuracy, "bytes_per_step": job.info["bytes_per_step"]["total"],
            "ps_link_use": use, "ps_link_use_steady": steady_use, "job_seconds": seconds, "host_clock": host,
            "arrival_offsets": arrival_offsets(history), "call_boundaries": call_boundaries(history),
            "machine_busy": (busy_after[0] - busy_before[0]) / (busy_after[1] - busy_before[1])}


def precision(repeats: int, steps: int, backend: str, workers: int, long_calls: int | None = None,
              mtu: int | None = None) -> dict:
    import workbench as wb

    settings = ("fp32-serial", "fp32", "bf16", "int8")  # fp32-serial: reads do not overlap pushes
    if long_calls:  # fp32-long: overlapped fp32 with ``long_calls`` steps per remote call instead of 10
        settings += ("fp32-long",)
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    with wb.Cluster(ps=1, workers=workers, network=dict(backend=backend, rate=LINK, mtu=mtu), progress=False) as cluster:
        links = cluster.network
        print(f"  links: {links}", flush=True)
        precision_run(cluster, "fp32", 40)  # warm-up: functions, channels, the relay's connections
        for _ in range(repeats):
            for setting in settings:
                run = precision_run(cluster, setting.split("-")[0], steps, overlap=not setting.endswith("serial"),
                                    steps_per_call=long_calls if setting == "fp32-long" else DEFAULT_STEPS_PER_CALL)
                runs[setting].append(run)
                print(f"  {setting}: {run['steps_per_s']:.1f} steps/s, accuracy {run['accuracy']:.3f}, "
                      f"{run['bytes_per_step'] / 1e6:.2f} MB/step, ps link use in steady state out "
                      f"{run['ps_link_use_steady']['out']:.2f} in {run['ps_link_use_steady']['in']:.2f} (whole job "
                      f"{run['ps_link_use']['out']:.2f}, {run['ps_link_use']['in']:.2f} over {run['job_seconds']:.0f} s), machine CPU "
                      f"{run['machine_busy']:.0%} busy; host clock {run['host_clock']['steps_per_s']:.1f} steps/s, "
                      f"{run['host_clock']['use']:.2f} of the parameters' bound", flush=True)
                if setting == "fp32" and run["arrival_offsets"]:
                    offsets = run["arrival_offsets"]
                    print(f"    workers' parameter arrivals apart: {offsets['offset_ms_p50']:.0f} ms median (10th-90th "
                          f"percentile {offsets['offset_ms_p10']:.0f}-{offsets['offset_ms_p90']:.0f}) of a "
                          f"{offsets['cycle_ms']:.0f} ms cycle", flush=True)
                if setting.startswith("fp32") and run["call_boundaries"]:
                    bounds = run["call_boundaries"]
                    print(f"    a worker's cycle across the end of a call {bounds['across_ms']:.0f} ms, within a call "
                          f"{bounds['within_ms']:.0f} ms (medians)", flush=True)
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
            "machine_busy": statistics.median(r["machine_busy"] for r in rs),
            "host_clock_steps_per_s": statistics.median(r["host_clock"]["steps_per_s"] for r in rs),
            "host_clock_use": statistics.median(r["host_clock"]["use"] for r in rs),
            "repeats": [round(r["steps_per_s"], 2) for r in rs],
            "arrival_offsets": [r["arrival_offsets"] for r in rs],
            "call_boundaries": [r["call_boundaries"] for r in rs],
        }
    fp32 = summary["fp32"]
    ratios = {s: {"speed": summary[s]["steps_per_s"] / fp32["steps_per_s"],
                  "speed_host_clock": summary[s]["host_clock_steps_per_s"] / fp32["host_clock_steps_per_s"],
                  "accuracy_points": 100 * (summary[s]["accuracy"] - fp32["accuracy"]),
                  "per_repeat": [round(a["steps_per_s"] / b["steps_per_s"], 3) for a, b in zip(runs[s], runs["fp32"])]}
              for s in ("bf16", "int8", "fp32-long") if s in runs}
    ratios["fp32"] = {"speed": fp32["steps_per_s"] / summary["fp32-serial"]["steps_per_s"],
                      "speed_host_clock": fp32["host_clock_steps_per_s"] / summary["fp32-serial"]["host_clock_steps_per_s"],
                      "accuracy_points": 100 * (fp32["accuracy"] - summary["fp32-serial"]["accuracy"]),
                      "per_repeat": [round(a["steps_per_s"] / b["steps_per_s"], 3)
                                     for a, b in zip(runs["fp32"], runs["fp32-serial"])]}
    return {"link": LINK, "links": links, "mtu": mtu or 1500, "workers": workers, "hidden": HIDDEN, "steps": steps,
            "long_calls": long_calls, "lines": summary, "ratios": ratios}


def measured_rate(cluster, transfer: str, batch: int, steps: int) -> float:
    """Steady-state steps/s of the wide model's digits job."""
    return steady_rate(completion_points(wide_job(cluster, transfer, batch, steps).history))


def cost_model(steps: int, backend: str, repeats: int) -> dict:
    """``wb.estimate`` against measurement: transfer x global batch x link, 1 ps + 2 workers, async-ps."""
    import workbench as wb

    rows = []
    with wb.Cluster(ps=1, workers=2, network=dict(backend=backend), progress=False) as cluster:
        print(f"  links: {cluster.network}", flush=True)
        measured_rate(cluster, "fp32", 64, 40)  # warm-up
        for transfer in ("fp32", "bf16"):
            for batch in (64, 512):
                cluster.shape(None)
                profile = wb.estimate(wide_model, cluster, batch, wb.AsyncPS(transfer=transfer, overlap=True)).profile
                links = ["1gbit", "10gbit"]
                runs: dict[str, list[float]] = {link: [] for link in links}
                for repeat in range(repeats):
                    for link in links if repeat % 2 == 0 else links[::-1]:
                        cluster.shape(link)
                        runs[link].append(measured_rate(cluster, transfer, batch, steps))
                for link in links:
                    predicted = wb.estimate(wide_model, cluster, batch, wb.AsyncPS(transfer=transfer, overlap=True), link=link,
                                            profile=profile)
                    measured = statistics.median(runs[link])
                    rows.append({"transfer": transfer, "batch": batch, "link": link, "predicted": predicted.steps_per_s,
                                 "measured": measured, "repeats": runs[link], "error": measured / predicted.steps_per_s - 1,
                                 "bottleneck": predicted.bottleneck, "profile": asdict(profile)})
                    print(f"  {transfer} batch {batch:>3} {link:>6}: predicted {predicted.steps_per_s:6.1f} steps/s "
                          f"({predicted.bottleneck}), measured {measured:6.1f} (median of "
                          f"{', '.join(f'{r:.1f}' for r in runs[link])}): {rows[-1]['error']:+.0%}", flush=True)
    return {"rows": rows, "worst": max(abs(r["error"]) for r in rows), "repeats": repeats}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("backends", "precision", "cost", "convergence", "all"), default="all")
    parser.add_argument("--seeds", type=int, default=5, help="seeds of the convergence part")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workers", type=int, default=2, help="workers of the precision part (one ps)")
    parser.add_argument("--long-calls", type=int, default=None, metavar="K",
                        help="precision part: also overlapped fp32 with K steps per remote call (fp32-long), alternating")
    parser.add_argument("--mtu", type=int, default=None, help="precision part: the netns links' MTU (9000: jumbo frames; "
                        "default 1500, Ethernet's)")
    parser.add_argument("--backend", choices=("auto", "netns", "user"), default="auto",
                        help="the links of the precision and cost parts (auto: netns as root, else user)")
    args = parser.parse_args()
    results: dict = {}
    if args.part in ("backends", "all"):
        print("each backend, a sender process pushing through it (payload bits the receiver got):", flush=True)
        results["backends"] = backends(args.repeats)
    if args.part in ("precision", "all"):
        print(f"async-ps, 1 ps + {args.workers} workers behind {LINK} links (MTU {args.mtu or 1500}), MLP "
              f"64-{HIDDEN}-{HIDDEN}-10:", flush=True)
        results["precision"] = precision(args.repeats, args.steps, args.backend, args.workers, args.long_calls, args.mtu)
        for setting, line in results["precision"]["lines"].items():
            print(f"{setting}: ps link use in steady state out {line['ps_link_use_steady_out']:.3f} in "
                  f"{line['ps_link_use_steady_in']:.3f}; on the host clock {line['host_clock_use']:.3f} of the "
                  f"parameters' bound (medians)")
        for setting, ratio in results["precision"]["ratios"].items():
            base = "fp32-serial" if setting == "fp32" else "fp32"
            goal = {"bf16": " (goal >= 1.9, accuracy within 1 point)", "fp32": " (overlap)"}.get(setting, "")
            print(f"{setting} / {base}: {ratio['speed']:.2f}x steps/s ({ratio['speed_host_clock']:.2f}x on the host "
                  f"clock){goal}, accuracy "
                  f"{ratio['accuracy_points']:+.1f} points; per repeat {ratio['per_repeat']}")
    if args.part in ("cost", "all"):
        print("wb.estimate against measurement (async-ps, 1 ps + 2 workers, the same wide MLP):", flush=True)
        results["cost_model"] = cost_model(args.steps, args.backend, args.repeats)
        print(f"cost model: worst error {results['cost_model']['worst']:.0%} (goal: within 15%)")
    if args.part in ("convergence", "all"):
        print(f"int8 against fp32, async-ps, 1 ps + 3 workers behind {LINK} links, {args.seeds} seeds:", flush=True)
        found = results["convergence"] = convergence(args.seeds, args.steps, args.backend)
        print(f"int8 converged in {found['int8_converged']}/{found['seeds']} seeds (within 0.02 of fp32's median "
              f"{found['fp32_median']:.3f}); int8 median {found['int8_median']:.3f}")
    for backend, found in results.get("backends", {}).items():
        print(f"{backend}: rates held within 10%: {', '.join(found['claimed'])}; unshaped "
              f"{found['unshaped_gbit']:.1f} Gbit/s")
    out = Path(__file__).resolve().parent / "results" / "network.json"
    out.parent.mkdir(exist_ok=True)
    kept = json.loads(out.read_text()) if out.exists() else {}  # the parts not run this time keep their results
    out.write_text(json.dumps({**kept, **results}, indent=2))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
