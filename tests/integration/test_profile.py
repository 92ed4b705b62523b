"""cluster.profile: one op-level trace of every task, parsed, linked, exported, drawn."""

import json
import time
import urllib.request

import pytest
from training_helpers import train

import workbench as wb
from workbench.telemetry.profiler import ProfileError

pytestmark = pytest.mark.cluster


def test_profile_traces_every_task_and_links_sends_between_them(cluster, tmp_path):
    job = train(cluster, strategy=wb.AsyncPS(steps_per_call=10), steps=100_000)
    try:
        deadline = time.monotonic() + 120
        while job.steps_done < 20 and time.monotonic() < deadline:  # training is under way
            time.sleep(0.1)
        before = time.time()
        profile = cluster.profile(seconds=2)
    finally:
        job.stop()
    tasks = {e.task for e in profile.events}
    assert {"ps:0", "worker:0", "worker:1"} <= tasks
    assert profile.rows[0].startswith("/job:ps/task:0/device:CPU:0 · ")  # ps first, one row per thread
    ops = {e.op_type for e in profile.events}
    assert {"_Send"} <= ops and ops & {"MatMul", "_MklMatMul", "_MklNativeFusedMatMul"}
    assert all(before - 5 < e.start <= e.end < time.time() + 5 for e in profile.events)  # on the kernel's clock
    # the worker reads its parameters from the ps, and sends its gradients there
    links = {(send.task, receiver.task) for send, receiver in profile.transfers}
    assert ("ps:0", "worker:0") in links or ("ps:0", "worker:1") in links
    assert ("worker:0", "ps:0") in links or ("worker:1", "ps:0") in links
    for send, receiver in profile.transfers[:200]:
        assert send.op_type == "_Send" and receiver.device == send.target_device != send.device
        assert receiver.start >= send.start
    summary = profile.summary()
    assert summary["events"]["ps:0"] > 0 and summary["transfers"]
    sends = [e for e in profile.events if e.is_transfer and "Send" in e.op_type and e.target_device != e.device]
    assert len(profile.transfers) + sum(summary["unlinked_sends"].values()) == len(sends)  # every Send accounted for
    assert len({id(send) for send, _ in profile.transfers}) == len(profile.transfers)

    path = profile.save_chrome_trace(tmp_path / "trace.json")
    trace = json.loads(path.read_text())["traceEvents"]
    complete = [e for e in trace if e["ph"] == "X"]
    assert len(complete) == len(profile.events) and all(e["dur"] >= 0 for e in complete)
    flows = [e for e in trace if e["ph"] in ("s", "f")]
    assert len(flows) == 2 * len(profile.transfers)
    starts = {(e["pid"], e["tid"], e["ts"]) for e in complete}
    assert all((f["pid"], f["tid"], f["ts"]) in starts for f in flows)  # each end on a traced op
    assert cluster.last_profile is profile
    server = wb.serve_dashboard(cluster)  # the served /profile page draws the newest profile
    page = urllib.request.urlopen(f"{server.url}/profile", timeout=60).read().decode()
    assert "Bokeh" in page
    layout = profile.plot()  # the timeline component draws it
    sources = {m.name: m for m in layout.select({"type": __import__("bokeh.models").models.ColumnDataSource})}
    assert len(sources["profile_ops"].data["left"]) == len(profile.events)
    assert len(sources["profile_transfers"].data["x0"]) == len(profile.transfers)


@pytest.mark.parametrize("seconds", [0, -1, 61, float("nan"), "2"])
def test_bad_durations_are_refused_before_anything_starts(cluster, seconds):
    with pytest.raises(wb.ConfigurationError, match="seconds="):
        cluster.profile(seconds=seconds)


def test_profiling_an_idle_cluster_says_what_happened_and_what_to_do(no_leftover_processes):
    # a cluster of its own: the shared one still runs input pipelines of earlier tests' jobs on its workers
    with wb.Cluster(ps=0, workers=1, name="wb-test-idle-profile", progress=False) as idle:
        with pytest.raises(ProfileError, match=r"nothing ran on the tasks .* during the 1 s capture.*while a job trains"):
            idle.profile(seconds=1)
