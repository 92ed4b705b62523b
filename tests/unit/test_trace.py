"""Profiler traces: parsing a capture taken here, linking transfers, the Chrome trace export."""

import json
import time
from pathlib import Path

import pytest

from workbench.dashboard.profile_view import link_columns, op_columns, op_kind
from workbench.telemetry.events import OpEvent
from workbench.telemetry.trace import chrome_trace, link_transfers, parse_xspace, save_chrome_trace

PS = "/job:ps/replica:0/task:0/device:CPU:0"
W0 = "/job:worker/replica:0/task:0/device:CPU:0"


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


def test_save_chrome_trace_writes_json(tmp_path):
    path = save_chrome_trace([op("ps:0", PS, "a", "Add", 1.0, 1.5)], tmp_path / "sub" / "t.json")
    assert json.loads(path.read_text())["traceEvents"][-1]["dur"] == pytest.approx(5e5)
