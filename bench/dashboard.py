"""Dashboard benchmarks, each measured as a ratio or distribution within one run.

1. Telemetry cost: pairs of the same async-ps job, telemetry off and then on with the dashboard
   live in the kernel (the notebook dashboard's update thread and the Bokeh server). Goal: >= 0.98
   of the steps/s (median of the pairs' ratios). Also the kernel CPU the dashboard threads used, as
   a share of one core (goal <= 5% at 100 steps/s).
2. Latency: a /dashboard page open in headless Chromium (on this machine) while a job trains: from
   a step ending on a worker (its worker-side end) to its bar in the page's data source
   (``Date.now()``; one machine, one clock), with the kernel's part. Goal: median <= 0.5 s.
3. Scale: 100,000 timeline events in the log and in the browser's timeline (its rollover), then
   100 steps/s more: time to first render, latency of new bars, the longest main-thread task, and
   the server thread's CPU. Also with the timeline in one segment (one data source), for comparison.
4. Profile capture: steps/s during a 2 s capture against outside it, and parse time per 100k events
   (``bench/profile_capture.py``).
5. Page load: the share of the browser's main thread a /dashboard page keeps busy while an async-ps job
   trains, shown against tagged hidden as JupyterLab's pane tags it behind another tab (its app then sends
   nothing), in alternating windows of one page.

    python bench/dashboard.py [--pairs 7] [--steps 1500] [--skip cost latency scale profile page]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import types
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).parent))
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# Runs in the page: every 5 ms, note the rows that arrived in the timeline's data source and how long
# after their end they arrived; record main-thread long tasks.
SEGMENTS = """() => [...Bokeh.documents[0]._all_models.values()]
  .filter((m) => m.name && m.name.startsWith("timeline_steps_"))"""
NEWEST = f"""() => Math.max(0, ...({SEGMENTS})().map((s) => s.data.right.length ? s.data.right[s.data.right.length - 1] : 0))"""
ROWS = f"""() => ({SEGMENTS})().reduce((n, s) => n + s.data.right.length, 0)"""
WATCH = f"""
(phase) => {{
  window.__latency = []; window.__long = [];
  new PerformanceObserver((list) => {{ for (const e of list.getEntries()) window.__long.push(e.duration); }})
    .observe({{entryTypes: ["longtask"]}});
  const watched = new Set();
  const watch = () => {{
    for (const source of ({SEGMENTS})()) {{
      if (watched.has(source)) continue;
      watched.add(source);
      let seen = source.data.right.length;
      source.streaming.connect(() => {{  // emitted once a stream has landed in the browser's data source
        const d = source.data, n = d.right.length, now = Date.now();
        for (let i = seen; i < n; i++) if (d.phase[i] === phase) window.__latency.push(now - d.right[i]);
        seen = n;
      }});
    }}
  }};
  watch(); setInterval(watch, 20);  // new segments appear as the timeline grows
}}
"""


def wait_for_timeline(page, timeout: float, log=None) -> None:
    """Until the page shows a timeline and, given the log, holds its newest bar (the backlog has arrived)."""
    page.wait_for_function("() => window.Bokeh && Bokeh.documents.length > 0 && "
                           f"({SEGMENTS})().length > 0", timeout=timeout * 1000)
    if log is not None:
        from workbench.telemetry import StepSpan

        ends = [e.end for e in log.since(max(0, log.cursor - 2000)).events if isinstance(e, StepSpan) and e.end]
        if ends:
            page.wait_for_function(f"() => ({NEWEST})() >= {max(ends) * 1000 - 1}", timeout=timeout * 1000)


@contextmanager
def chromium_page(url: str, timeout: float = 60.0):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(url, timeout=timeout * 1000)
            wait_for_timeline(page, timeout)
            yield page
        finally:
            browser.close()


def thread_cpu(native_ids: list[int]) -> float:
    import psutil

    return sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id in native_ids)


def make_model():
    import keras

    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                             keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])


def steps_per_second(job) -> float:
    history = job.history
    return len(history) / (max(r["end"] for r in history) - min(r["start"] for r in history))


def train(cluster, steps: int, telemetry: bool):
    import keras

    import workbench as wb

    return wb.train(cluster, make_model, wb.datasets.digits, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    "adam", steps=steps, batch_size=64, seed=0, telemetry=telemetry).wait(900)


def telemetry_cost(cluster, pairs: int, steps: int) -> dict:
    """Pairs of runs, alternating: telemetry off, then on with the dashboard live in the kernel (its
    update thread and the Bokeh server running, no page open). The ratio is the median of the
    pairs' ratios: the machine's load drifts between pairs more than within one."""
    import workbench as wb

    board = wb.dashboard(cluster)
    server = wb.serve_dashboard(cluster)
    results: dict[str, list] = {"off": [], "live": [], "cpu_share": []}
    train(cluster, 200, telemetry=False)  # warm-up: traced functions, caches
    for i in range(pairs):
        results["off"].append(steps_per_second(train(cluster, steps, telemetry=False)))
        board.start()
        threads = [board._thread.native_id, server.thread_id]
        cpu0, wall0 = thread_cpu(threads), time.monotonic()
        results["live"].append(steps_per_second(train(cluster, steps, telemetry=True)))
        results["cpu_share"].append((thread_cpu(threads) - cpu0) / (time.monotonic() - wall0))
        board.stop_updates()
        print(f"pair {i + 1}/{pairs}: off {results['off'][-1]:.1f} steps/s, dashboard live {results['live'][-1]:.1f} "
              f"(ratio {results['live'][-1] / results['off'][-1]:.3f}); dashboard CPU {100 * results['cpu_share'][-1]:.1f}% "
              "of a core", flush=True)
    ratios = [lv / of for lv, of in zip(results["live"], results["off"])]
    return {
        "steps_per_s_off": statistics.median(results["off"]), "steps_per_s_live": statistics.median(results["live"]),
        "ratio_live_over_off": statistics.median(ratios), "ratios": ratios,
        "dashboard_cpu_share_of_a_core": statistics.median(results["cpu_share"]), "raw": results,
    }


def browser_latency(cluster, steps: int, repeats: int = 3) -> dict:
    """A /dashboard page open in Chromium on this machine while a job trains: how late each step's bar
    arrives in the page's data source, split into the kernel's part (step end -> event in the log)
    and the rest (log -> server update -> websocket -> BokehJS). Also the job's steps/s meanwhile."""
    import workbench as wb
    from workbench.telemetry.events import PUSH_APPLY

    server = wb.serve_dashboard(cluster)
    log = cluster.telemetry
    kernel_delays: list[float] = []
    original = log.extend

    def timed_extend(events) -> None:  # notes when each step's last phase reaches the log
        events = list(events)
        now = time.time()
        kernel_delays.extend(1000 * (now - e.end) for e in events if getattr(e, "phase", "") == PUSH_APPLY)
        original(events)

    latency, rates = [], []
    with chromium_page(f"{server.url}/dashboard") as page:
        for _ in range(repeats):
            wait_for_timeline(page, 120, log)
            page.evaluate(WATCH, PUSH_APPLY)
            log.extend = timed_extend
            try:
                rates.append(steps_per_second(train(cluster, steps, telemetry=True)))
            finally:
                log.extend = original
            time.sleep(1.0)
            latency.extend(page.evaluate("() => window.__latency"))
            page.reload()
    latency.sort()
    kernel_delays.sort()
    return {"latency_ms_median": statistics.median(latency), "latency_ms_p90": latency[int(0.9 * len(latency))],
            "kernel_part_ms_median": statistics.median(kernel_delays), "samples": len(latency),
            "steps_per_s_with_page_here": statistics.median(rates)}


# what JupyterLab's pane does to its page behind another tab (the served app's root, by the name the server gives it)
JS_TAG_PAGE = """(tags) => { for (const d of Bokeh.documents) { const root = d.get_model_by_name(%r);
    if (root) root.tags = tags; } }"""


def page_load(cluster, pairs: int = 3, seconds: float = 8.0) -> dict:
    """Main-thread busy share (Chromium's TaskDuration per second) of one /dashboard page while an async-ps
    job trains: shown, then tagged hidden; ``pairs`` times."""
    import importlib

    import keras

    import workbench as wb

    served = importlib.import_module("workbench.dashboard.server")  # wb.dashboard is also a function
    tag_page = JS_TAG_PAGE % served.PAGE_ROOT
    server = wb.serve_dashboard(cluster)
    job = wb.train(cluster, make_model, wb.datasets.digits, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   strategy=wb.AsyncPS(steps_per_call=5), steps=10_000_000, seed=0)
    busy: dict[str, list[float]] = {"shown": [], "tagged_hidden": []}
    try:
        job.wait_set_up(300)
        with chromium_page(f"{server.url}/dashboard") as page:
            cdp = page.context.new_cdp_session(page)
            cdp.send("Performance.enable")

            def task_seconds() -> float:
                return next(m["value"] for m in cdp.send("Performance.getMetrics")["metrics"] if m["name"] == "TaskDuration")

            for _ in range(pairs):
                for name, tags in (("shown", []), ("tagged_hidden", [served.HIDDEN])):
                    page.evaluate(tag_page, tags)
                    page.wait_for_timeout(2000)  # the page settles
                    before, started = task_seconds(), time.monotonic()
                    page.wait_for_timeout(seconds * 1000)
                    busy[name].append((task_seconds() - before) / (time.monotonic() - started))
    finally:
        job.stop()
    return {"busy_shown": statistics.median(busy["shown"]), "busy_tagged_hidden": statistics.median(busy["tagged_hidden"]),
            "raw": busy}


def scale(events: int = 100_000, seconds: float = 10.0, steps_per_s: float = 100.0, segment_rows: int | None = None) -> dict:
    """A synthetic log: ``events`` spans kept, then steps at ``steps_per_s`` (2 workers) in chunks of 10."""
    from workbench.cluster.status import TaskRecord
    from workbench.dashboard import DashboardServer, timeline
    from workbench.telemetry import EventLog, StepSpan
    from workbench.telemetry.events import COMPUTE, PUSH_APPLY

    devices = [f"/job:worker/replica:0/task:{w}/device:CPU:0" for w in (0, 1)]
    tasks = [TaskRecord("ps", 0, 0, "local", devices=["/job:ps/replica:0/task:0/device:CPU:0"]),
             *[TaskRecord("worker", w, w + 1, "local", devices=[devices[w]]) for w in (0, 1)]]
    cluster = types.SimpleNamespace(name="scale", telemetry=EventLog(events), tasks=tasks, state="running")
    period = 2 / steps_per_s  # each worker steps at half the rate

    def spans(step: int, start: float, worker: int) -> list:
        task, mid, end = f"worker:{worker}", start + period * 0.7, start + period
        return [StepSpan(task, devices[worker], COMPUTE, start, mid, step, 1, 32, "synthetic"),
                StepSpan(task, devices[worker], PUSH_APPLY, mid, end, step, 1, 0, "synthetic")]

    t0 = time.time() - events / 2 * period / 2
    backlog = [s for i in range(events // 4) for w in (0, 1) for s in spans(i, t0 + i * period, w)]
    cluster.telemetry.extend(backlog)
    default = timeline.SEGMENT_ROWS
    timeline.SEGMENT_ROWS = segment_rows or default
    kept = timeline.TIMELINE_ROLLOVER
    server = DashboardServer(cluster).start()
    try:
        loaded = time.monotonic()
        with chromium_page(f"{server.url}/timeline", timeout=120) as page:
            page.wait_for_function(f"() => ({ROWS})() >= {min(events, kept)}", timeout=120_000)
            load_seconds = time.monotonic() - loaded
            page.evaluate(WATCH, PUSH_APPLY)
            stop = threading.Event()

            def produce() -> None:  # chunks of 10 steps per worker, as async-ps calls return them
                step = events // 4
                while not stop.is_set():
                    chunk_start = time.time()
                    time.sleep(10 * period)
                    cluster.telemetry.extend(s for i in range(10) for w in (0, 1)
                                             for s in spans(step + i, chunk_start + i * period, w))
                    step += 10

            producer = threading.Thread(target=produce, daemon=True)
            cpu0 = thread_cpu([server.thread_id])
            producer.start()
            time.sleep(seconds)
            stop.set()
            producer.join(5)
            time.sleep(1.0)
            cpu = thread_cpu([server.thread_id]) - cpu0
            latency = sorted(page.evaluate("() => window.__latency"))
            long_tasks = page.evaluate("() => window.__long")
            kept = page.evaluate(ROWS)
    finally:
        server.stop()
        timeline.SEGMENT_ROWS = default
    return {"events": events, "kept_in_browser": kept, "first_load_s": load_seconds,
            "latency_ms_median": statistics.median(latency) if latency else None,
            "latency_ms_p90": latency[int(0.9 * len(latency))] if latency else None,
            "longest_main_thread_task_ms": max(long_tasks, default=0.0), "long_tasks": len(long_tasks),
            "server_cpu_share_of_a_core": cpu / (seconds + 1.0), "steps_per_s": steps_per_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--skip", nargs="*", default=[], choices=["cost", "latency", "scale", "profile", "page"])
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "dashboard.json")
    args = parser.parse_args()
    import workbench as wb

    summary: dict = {}
    if "scale" not in args.skip:
        summary["scale"] = {"segments": scale(), "one_source": scale(segment_rows=100_000)}
        print("scale:", json.dumps(summary["scale"]), flush=True)
    if not {"cost", "latency", "profile", "page"} <= set(args.skip):
        with wb.Cluster(ps=1, workers=2, progress=False) as cluster:
            if "cost" not in args.skip:
                summary["telemetry"] = telemetry_cost(cluster, args.pairs, args.steps)
                print("telemetry:", json.dumps({k: v for k, v in summary["telemetry"].items() if k != "raw"}), flush=True)
            if "latency" not in args.skip:
                summary["latency"] = browser_latency(cluster, args.steps)
                print("latency:", json.dumps(summary["latency"]), flush=True)
            if "profile" not in args.skip:
                import profile_capture

                summary["profile"] = {"capture": profile_capture.measure_capture_slowdown(cluster, seconds=2),
                                      "parse": profile_capture.measure_parse()}
                print("profile:", json.dumps(summary["profile"]), flush=True)
            if "page" not in args.skip:
                summary["page"] = page_load(cluster, args.pairs)
                print("page:", json.dumps(summary["page"]), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
