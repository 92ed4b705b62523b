"""Profiler traces: parsing a capture taken here, linking transfers, the Chrome trace export; the
profiler's checks that need no cluster (arguments, state, which trace file is whose)."""

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from workbench.dashboard.profile_view import link_columns, op_columns, op_kind
from workbench.errors import ConfigurationError
from workbench.telemetry.events import OpEvent
from workbench.telemetry.profiler import ProfileError, _find_traces, capture
from workbench.telemetry.trace import (
    UNLINKED_NOT_TRACED,
    UNLINKED_OUTSIDE,
    UNLINKED_TO_CLIENT,
    chrome_trace,
    explain_unlinked,
    link_transfers,
    parse_xspace,
    save_chrome_trace,
)

PS = "/job:ps/replica:0/task:0/device:CPU:0"
W0 = "/job:worker/replica:0/task:0/device:CPU:0"
W1 = "/job:worker/replica:0/task:1/device:CPU:0"


@pytest.fixture(scope="module")
def local_capture(tmp_path_factory):
    """A real capture of this process: a small function, traced by TensorFlow's profiler."""
    import tensorflow as tf

    logdir = tmp_path_factory.mktemp("profile")

    @tf.function
    def work(x):
        for _ in tf.range(20):
            x = tf.tanh(tf.matmul(x, x))
        return x

    work(tf.ones([64, 64]))  # traced before the capture
    before = time.time()
    tf.profiler.experimental.start(str(logdir))
    for _ in range(5):
        work(tf.ones([64, 64])).numpy()
    tf.profiler.experimental.stop()
    after = time.time()
    files = list(Path(logdir).glob("plugins/profile/*/*.xplane.pb"))
    assert len(files) == 1
    return files[0], before, after


def test_parse_a_capture_taken_here(local_capture):
    path, before, after = local_capture
    events = parse_xspace(path, "worker:0", "/job:worker/replica:0/task:0")
    assert events, "no op events parsed"
    types = {e.op_type for e in events}
    assert types & {"MatMul", "_MklMatMul"} and "Tanh" in types
    assert all(before - 1 < e.start <= e.end < after + 1 for e in events)  # absolute, on this clock
    assert all(e.device == W0 and e.row.startswith("/job:worker/task:0/device:CPU:0 · ") for e in events)
    assert [e.start for e in events] == sorted(e.start for e in events)
    shifted = parse_xspace(path.read_bytes(), "worker:0", "/job:worker/replica:0/task:0", clock_offset=10.0)
    assert shifted[0].start == pytest.approx(events[0].start - 10.0)
    trace = json.loads(json.dumps(chrome_trace(events)))
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == len(events)
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in trace["traceEvents"] if e["ph"] == "X")
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {e.row.split(" · ")[-1] for e in events}


def assert_flows_bind_to_slices(trace: dict) -> int:
    """Every flow end sits at the start of an X event on its thread (where Perfetto draws it)."""
    starts = {(e["pid"], e["tid"], e["ts"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    flows = [e for e in trace["traceEvents"] if e["ph"] in ("s", "f")]
    assert all((f["pid"], f["tid"], f["ts"]) in starts for f in flows)
    assert sorted(f["id"] for f in flows if f["ph"] == "s") == sorted(f["id"] for f in flows if f["ph"] == "f")
    return len(flows) // 2


def op(task, device, name, op_type, start, end, key="", target="", to=""):
    return OpEvent(task, device, f"{device} · tf_Compute #1", name, op_type, start, end, key, device if key else "",
                   target, {"to": to} if to else {})


def test_a_send_links_to_its_consumer_on_the_other_task_after_it_started():
    key = f"{PS};1;{W0};edge_1_read;0:0"
    events = [
        op("worker:0", W0, "dense/MatMul", "MatMul", 0.5, 0.6),  # before the send: not its receiver
        op("ps:0", PS, "read/_1", "_Send", 1.0, 1.1, key, W0, to="dense/MatMul"),
        op("worker:0", W0, "dense/MatMul", "MatMul", 1.05, 1.2),
        op("worker:0", W0, "dense/MatMul", "MatMul", 1.3, 1.4),
        op("ps:0", PS, "read/_1", "_Send", 5.0, 5.1, key, W0, to="dense/MatMul"),  # no consumer within 1 s
    ]
    pairs = link_transfers(events)
    assert [(s.start, r.start) for s, r in pairs] == [(1.0, 1.05)]
    recv = op("worker:0", W0, "read/_2", "_Recv", 5.2, 5.3, key, W0)
    assert [(s.start, r.op_type) for s, r in link_transfers([*events, recv])] == [(1.0, "MatMul"), (5.0, "_Recv")]

    trace = chrome_trace(events, pairs)
    flows = [e for e in trace["traceEvents"] if e["ph"] in ("s", "f")]
    assert [(f["ph"], f["id"]) for f in flows] == [("s", 1), ("f", 1)]
    processes = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert processes == {f"ps:0 {PS}", f"worker:0 {W0}"}
    assert min(e["ts"] for e in trace["traceEvents"] if e["ph"] == "X") == 0.0
    assert op_kind(events[1]) == "send" and op_kind(events[2]) == "op"
    assert op_columns(events)["duration_us"][1] == pytest.approx(1e5)
    assert link_columns(pairs)["y1"] == [events[2].row]


def test_a_missing_consumer_run_leaves_one_send_unlinked_without_shifting_the_later_pairs():
    kernel, bias = f"{PS};1;{W0};edge_1_kernel;0:0", f"{PS};1;{W0};edge_2_bias;0:0"
    events = [
        op("ps:0", PS, "kernel/_1", "_Send", 1.0, 1.01, kernel, W0, to="dense/Relu"),
        op("ps:0", PS, "bias/_2", "_Send", 1.0, 1.01, bias, W0, to="dense/Relu"),
        op("worker:0", W0, "dense/Relu", "_FusedMatMul", 1.02, 1.03),  # one fused run reads both
        op("ps:0", PS, "kernel/_1", "_Send", 2.0, 2.01, kernel, W0, to="dense/Relu"),  # its run is not in the trace
        op("ps:0", PS, "kernel/_1", "_Send", 3.0, 3.01, kernel, W0, to="dense/Relu"),
        op("worker:0", W0, "dense/Relu", "_FusedMatMul", 3.02, 3.03),
        op("worker:1", W1, "ctrl/_3", "_Send", 3.5, 3.51, f"{W1};1;{PS};edge_3_ctrl;0:0", PS, to="Func/input/_9"),
        op("worker:1", W1, "out/_4", "_Send", 3.6, 3.61, f"{W1};1;/job:localhost/replica:0/task:0/device:CPU:0;r;0:0",
           "/job:localhost/replica:0/task:0/device:CPU:0"),
        op("ps:0", PS, "kernel/_1", "_Send", 4.0, 4.01, kernel, W0, to="dense/Relu"),  # the capture ended first
    ]
    pairs = link_transfers(events)
    assert [(s.name, s.start, r.start) for s, r in pairs] == [
        ("kernel/_1", 1.0, 1.02), ("bias/_2", 1.0, 1.02), ("kernel/_1", 3.0, 3.02)]
    assert explain_unlinked(events, pairs) == {UNLINKED_OUTSIDE: 2, UNLINKED_NOT_TRACED: 1, UNLINKED_TO_CLIENT: 1}


def test_chrome_trace_links_a_send_and_its_recv_itself_and_lists_ps_first():
    key = f"{PS};1;{W0};edge_1_read;0:0"
    events = [
        op("worker:0", W0, "dense/MatMul", "MatMul", 0.9, 1.0),
        op("ps:0", PS, "read/_1", "_Send", 1.0, 1.1, key, W0),
        op("worker:0", W0, "read/_2", "_Recv", 1.02, 1.3, key, W0),
    ]
    trace = json.loads(json.dumps(chrome_trace(events)))  # no transfers given: linked by key
    assert assert_flows_bind_to_slices(trace) == 1
    flow_pids = [f["pid"] for f in trace["traceEvents"] if f["ph"] in ("s", "f")]
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert [names[pid] for pid in flow_pids] == [f"ps:0 {PS}", f"worker:0 {W0}"]
    assert names[1].startswith("ps:0")  # ps first, though a worker op came first
    assert not [e for e in chrome_trace(events, ())["traceEvents"] if e["ph"] in ("s", "f")]


def test_save_chrome_trace_writes_json(tmp_path):
    path = save_chrome_trace([op("ps:0", PS, "a", "Add", 1.0, 1.5)], tmp_path / "sub" / "t.json")
    assert json.loads(path.read_text())["traceEvents"][-1]["dur"] == pytest.approx(5e5)


def record(name, engine_id):
    return SimpleNamespace(name=name, engine_id=engine_id)


def test_trace_files_map_to_tasks_by_profiler_port_and_older_runs_are_ignored(tmp_path):
    old, new = tmp_path / "plugins/profile/2026_01_01_00_00_00", tmp_path / "plugins/profile/2026_01_01_00_00_05"
    for folder in (old, new):
        folder.mkdir(parents=True)
    (old / "127.0.0.1_5002.xplane.pb").write_bytes(b"")
    os.utime(old / "127.0.0.1_5002.xplane.pb", (time.time() - 600, time.time() - 600))
    (new / "127.0.0.1_5001.xplane.pb").write_bytes(b"")
    records, ports = [record("ps:0", 0), record("worker:1", 3)], {"ps:0": 5001, "worker:1": 5002}
    since = time.time() - 60
    assert _find_traces(str(tmp_path), records[:1], ports, since) == {"ps:0": new / "127.0.0.1_5001.xplane.pb"}
    with pytest.raises(ProfileError, match=r"profiler on worker:1 \(engine 3, port 5002\) wrote no trace"):
        _find_traces(str(tmp_path), records, ports, since)
    with pytest.raises(ProfileError, match="wrote no trace files"):
        _find_traces(str(tmp_path), records, ports, time.time() + 60)


def test_capture_refuses_a_stopped_cluster_and_a_timeout_shorter_than_the_trace():
    stopped = SimpleNamespace(name="demo", state="stopped")
    with pytest.raises(ProfileError, match="it is stopped. Start it first"):
        capture(stopped, seconds=1)
    with pytest.raises(ConfigurationError, match="timeout=1.0 must exceed seconds=2"):
        capture(stopped, seconds=2, timeout=1)
