"""The dashboards on a real job: every worker's row, in-progress steps, throughput = history."""

import dataclasses
import json
import math
import time
import urllib.error
import urllib.request

import pytest
from training_helpers import train

import workbench as wb
from workbench.cluster import registry
from workbench.dashboard import PlotEntry
from workbench.dashboard.data import TOTAL, row_name

pytestmark = pytest.mark.cluster


def _run_with_dashboard(cluster, job, board, timeout=300):
    """Update the dashboard like its live thread does, noting the in-progress bars seen, until the job ends."""
    seen_running = []  # (time seen, task, first step, steps)
    deadline = time.monotonic() + timeout
    while job.state in ("queued", "running") and time.monotonic() < deadline:
        board.update()
        if "timeline" in board.components:
            data = board.components["timeline"].open_source.data
            now = time.time()
            seen_running += [(now, t, s, n) for t, s, n in zip(data["task"], data["step"], data["steps"])]
        time.sleep(0.02)
    job.wait(10)
    return seen_running


def test_timeline_shows_every_worker_and_steps_while_they_run(cluster):
    board = wb.dashboard(cluster, interval=0.1)
    timeline = board.components["timeline"]
    board.update()
    start = len(timeline.columns()["left"])  # earlier jobs on the session's cluster come first
    job = train(cluster, strategy=wb.AsyncPS(steps_per_call=20), steps=400)
    seen_running = _run_with_dashboard(cluster, job, board)
    time.sleep(0.3)
    board.update()
    data = timeline.columns()
    mine = [i for i in range(start, len(data["job"])) if data["job"][i] == job.name]
    rows = {data["row"][i] for i in mine}
    for worker in ("worker:0", "worker:1"):
        assert row_name(cluster.task(worker).task.device + "/device:CPU:0") in rows
        assert row_name(cluster.task(worker).task.device + "/device:CPU:0") in timeline.plot.y_range.factors
    assert row_name(cluster.task("ps:0").task.device + "/device:CPU:0") in timeline.plot.y_range.factors
    phases = {data["phase"][i] for i in mine}
    assert phases == {"compute", "push+apply"}
    computed = sorted(data["step"][i] for i in mine if data["phase"][i] == "compute")
    assert computed == list(range(400))  # one compute bar per step, none lost
    assert all(data["right"][i] >= data["left"][i] for i in mine)
    # A call's bar is drawn while it runs: some step it covers ended after the bar was seen.
    assert seen_running, "no in-progress bar was seen during the job"
    ends = {(data["task"][i], data["step"][i]): data["right"][i] / 1000 for i in mine if data["phase"][i] == "push+apply"}
    early = [(seen, task, first) for seen, task, first, n in seen_running
             if any(ends.get((task, s), 0) > seen for s in range(first, first + n))]
    assert early, "every in-progress bar was seen only after its steps had ended"
    assert timeline.open_source.data["left"] == []  # nothing is left running
    board.close()


def _binned(throughput) -> dict[int, tuple[float, float]]:
    """The cluster total per bin: index -> (examples, steps) rates (a gap, NaN, counts nothing)."""
    data = throughput.source.data
    return {int(round(t / 1000 / throughput.bins.width)): (0.0 if math.isnan(e) else e, 0.0 if math.isnan(s) else s)
            for t, e, s in zip(data["time"], data[f"{TOTAL}:examples"], data[f"{TOTAL}:steps"])}


@pytest.mark.parametrize("strategy", [wb.AsyncPS, wb.SyncPS], ids=["async-ps", "sync-ps"])
def test_throughput_agrees_with_job_history(cluster, strategy):
    board = wb.dashboard(cluster, plots=("throughput", "progress"))
    throughput = board.components["throughput"]
    board.update()
    # earlier jobs on the session's cluster are binned too, and the last can share a bin with this one
    time.sleep(throughput.bins.settle + throughput.bins.width + 0.2)
    board.update()
    before = _binned(throughput)
    job = train(cluster, strategy=strategy(steps_per_call=5), steps=150)
    _run_with_dashboard(cluster, job, board)
    time.sleep(throughput.bins.settle + throughput.bins.width + 0.2)
    board.update()
    offsets = cluster.clock_offsets()
    expected: dict[int, list] = {}
    for record in job.history:
        end = record["end"] - offsets[record["worker"].split(",")[0]]
        slot = expected.setdefault(int(math.floor(end / throughput.bins.width)), [0, 0])
        slot[0] += record["examples"]
        slot[1] += 1
    got = _binned(throughput)
    for index, (examples, steps) in expected.items():
        earlier = before.get(index, (0.0, 0.0))
        assert (got[index][1] - earlier[1]) * throughput.bins.width == pytest.approx(steps, abs=1e-9)
        assert (got[index][0] - earlier[0]) * throughput.bins.width == pytest.approx(examples, abs=1e-6)
    assert sum(got[i][1] - before.get(i, (0, 0))[1] for i in expected) * throughput.bins.width == pytest.approx(
        len(job.history), abs=1e-6)
    data = throughput.source.data
    per_worker = {w: sum(v for v in data[f"{w}:steps"] if not math.isnan(v)) for w in ("worker:0", "worker:1")}
    assert all(v > 0 for v in per_worker.values()), per_worker
    progress = board.components["progress"].info
    assert progress["job"] == job.name and progress["state"] == "finished"
    assert progress["steps_done"] == progress["steps_total"] == 150
    board.close()


def test_telemetry_off_records_nothing(cluster):
    cursor = cluster.telemetry.cursor
    train(cluster, steps=30, telemetry=False).wait(300)
    assert cluster.telemetry.cursor == cursor


def test_served_apps_list_their_plots_and_render(cluster, registry_dir):
    server = wb.serve_dashboard(cluster)
    assert wb.serve_dashboard(cluster) is server  # one server per cluster
    listing = json.loads(urllib.request.urlopen(f"{server.url}/plots.json", timeout=10).read())
    assert listing["cluster"] == cluster.name
    assert [p["name"] for p in listing["plots"]] == ["progress", "throughput", "timeline", "dashboard", "profile"]
    fields = {f.name for f in dataclasses.fields(PlotEntry)}  # the contract the JupyterLab panel reads
    assert all(set(p) == fields for p in listing["plots"])
    for plot in listing["plots"]:
        page = urllib.request.urlopen(plot["url"], timeout=30).read().decode()
        assert "Bokeh" in page and "cdn.bokeh.org" not in page
    summary = json.loads(urllib.request.urlopen(f"{server.url}/summary.json", timeout=10).read())
    assert summary["cluster"] == cluster.name
    job = summary["job"]  # the newest job the session's cluster ran (earlier tests trained on it)
    assert job["state"] in ("finished", "running") and job["steps_done"] <= job["steps_total"]
    assert {"examples_per_s", "steps_per_s", "eta_s", "notes", "workers"} <= set(job)
    record = registry.read_record(cluster.name)
    assert record.endpoints["dashboard"].url == server.url  # the panel finds the plots at <url>/plots.json
    for route in ("plots.json", "summary.json"):  # a page on a rebound host name cannot read them
        rebound = urllib.request.Request(f"{server.url}/{route}", headers={"Host": "attacker.example"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(rebound, timeout=10)
        assert info.value.code == 403
    assert server.url.startswith("http://127.0.0.1:")


def test_a_live_dashboard_is_held_by_its_cluster_until_updates_stop(cluster):
    board = wb.dashboard(cluster, plots=("progress",), interval=0.05).start()
    thread, key = board._thread, board._key
    assert cluster.kept(key) is board and thread.is_alive()
    del board  # dropped by the notebook: still live (the widget on the page keeps updating)
    assert thread.is_alive()
    board = cluster.kept(key)
    board.stop_updates()
    assert cluster.kept(key) is None and not thread.is_alive()
    assert repr(board).endswith("dashboard.serve() for URLs to open in a browser>") and "not live" in repr(board)


def test_a_jobs_dashboard_shows_that_job_alone_and_stays_on_its_end(cluster):
    first = train(cluster, strategy=wb.AsyncPS(steps_per_call=5), steps=200)
    board = wb.dashboard(first, interval=0.05).start()  # live while it trains, then on its final state
    first.wait(300)
    deadline = time.monotonic() + 30
    while board._thread is not None and board._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert board.over and not board._thread.is_alive() and cluster.kept(board._key) is None
    second = train(cluster, strategy=wb.SyncPS(), steps=50).wait(300)
    board.update()  # whatever comes after, it shows the first job
    bars = board.components["timeline"].columns()
    assert set(bars["job"]) == {first.name} and len(bars["step"]) >= 200
    assert board.components["progress"].info["job"] == first.name
    throughput = board.components["throughput"]
    assert f"job {first.name} finished: its average" in throughput.figure_div.text
    totals = throughput.source.data[f"{TOTAL}:steps"]
    drawn = [i for i, v in enumerate(totals) if not math.isnan(v)]
    assert sum(totals[i] for i in drawn) * throughput.bins.width == pytest.approx(200)  # its steps, no other job's
    assert drawn == list(range(drawn[0], len(totals)))  # one stretch, to the last row: nothing after the job
    # a row before the total's first count is one a worker counted in (its first step's compute ended in the bin
    # before the step did, under load): a gap in the total, not a row outside the job
    workers = [values for name, values in throughput.source.data.items() if name.endswith(":steps") and name != f"{TOTAL}:steps"]
    assert all(any(not math.isnan(values[i]) for values in workers) for i in range(drawn[0])), throughput.source.data
    late = wb.dashboard(second)  # made after the job ended: its whole job at once, not live
    late.update()
    assert set(late.components["timeline"].columns()["job"]) == {second.name} and late.over
    assert f"of job {second.name!r} on cluster" in repr(late) and late.start()._thread is None
    with pytest.raises(wb.ConfigurationError, match="pass a wb.Cluster, or a job"):
        wb.dashboard("sync-ps-1")


def test_a_live_dashboard_that_stops_on_an_error_says_so_above_its_plots(cluster):
    """A warning from the kernel's update thread may show in no cell: the widget itself says why it stopped."""
    board = wb.dashboard(cluster, plots=("progress",), interval=0.05)
    board.widget()  # the layout as displayed

    class Broken(RuntimeError):
        pass

    def update(now):
        raise Broken("the plot's document changed under the update")

    board.components["progress"].update = update  # as Bokeh failed in the live thread
    with pytest.warns(UserWarning, match="stopped updating: Broken"):
        board.start()
        board._thread.join(10)
    assert not board._thread.is_alive()
    notice = board.layout.children[0]
    assert notice.name == "dashboard_notice" and "stopped updating: Broken: the plot&#x27;s document" in notice.text
    assert "Display it again to resume" in notice.text
    del board.components["progress"].update  # the component's own update again, for close()'s last one
    board.close()


def test_a_jobs_timeline_saves_as_a_perfetto_trace_with_tasks_as_processes(cluster, tmp_path):
    job = train(cluster, strategy=wb.AsyncPS(steps_per_call=5), steps=60)
    job.wait(300)
    spans = job.timeline.spans()
    assert spans and {s.job for s in spans} == {job.name}
    path = job.timeline.save(tmp_path / "trace" / "job.json")
    trace = json.loads(path.read_text())
    assert trace["otherData"]["title"] == f"workbench job {job.name}"
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert {"worker:0", "worker:1"} <= set(processes.values()), processes
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == len(spans)
    assert {e["name"] for e in slices} >= {"compute"} and all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    worker_steps = sum(e["args"]["steps"] for e in slices
                       if processes[e["pid"]].startswith("worker") and e["name"] == "compute")
    assert worker_steps >= 60  # every step of the job has its compute slice on a worker
    threads = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert any(name.startswith("/job:worker/replica:0/task:0/device:") for _, name in threads), threads
