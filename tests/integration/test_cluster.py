"""A running local cluster, read by a plain TensorFlow client and through its records."""

import json
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from conftest import run_tf_client

import workbench as wb

pytestmark = pytest.mark.cluster


def test_spec_lists_every_task_on_loopback(cluster):
    spec = cluster.spec.as_dict()
    assert sorted(spec) == ["ps", "worker"]
    assert len(spec["ps"]) == 1 and len(spec["worker"]) == 2
    assert all(address.startswith("127.0.0.1:") for addresses in spec.values() for address in addresses)
    assert spec == cluster.spec_dict


def test_plain_tf_client_runs_ops_on_worker_1_and_ps_0(cluster):
    result = run_tf_client(cluster.spec_dict, """
        with tf.device("/job:worker/replica:0/task:1/device:CPU:0"):
            a = tf.matmul(tf.ones([2, 3]), tf.ones([3, 2]))
        with tf.device("/job:ps/replica:0/task:0/device:CPU:0"):
            v = tf.Variable([1.0, 2.0])
            v.assign_add([10.0, 10.0])
        result = {"matmul": a.numpy().tolist(), "a_device": a.device, "v": v.numpy().tolist(), "v_device": v.device}
    """)
    assert result["matmul"] == [[3.0, 3.0], [3.0, 3.0]]
    assert result["a_device"] == "/job:worker/replica:0/task:1/device:CPU:0"
    assert result["v"] == [11.0, 12.0]
    assert result["v_device"] == "/job:ps/replica:0/task:0/device:CPU:0"


def test_task_records_describe_engines_and_devices(cluster):
    records = cluster.tasks
    assert [r.name for r in records] == ["ps:0", "worker:0", "worker:1"]
    assert len({r.engine_id for r in records}) == 3
    assert set(cluster.client.ids) >= {r.engine_id for r in records}
    for record in records:
        assert record.state == "running"
        assert psutil.pid_exists(record.pid)
        assert record.address in cluster.spec_dict[record.job]
        assert record.devices == [f"/job:{record.job}/replica:0/task:{record.index}/device:CPU:0"]
        assert record.gpus == []  # CPU pool: every GPU hidden
        assert record.tensorflow
    assert cluster.task("worker:1") is records[2]
    with pytest.raises(wb.UnknownTaskError, match="no task worker:9: its tasks are ps:0, worker:0, worker:1"):
        cluster.task("worker:9")


def test_each_engine_hosts_its_own_server_on_a_port_it_reserved(cluster):
    ports = {int(r.address.rsplit(":", 1)[1]) for r in cluster.tasks}
    assert len(ports) == 3
    for record in cluster.tasks:
        port = int(record.address.rsplit(":", 1)[1])
        listeners = {c.laddr.port for c in psutil.Process(record.pid).net_connections("tcp") if c.status == "LISTEN"}
        assert port in listeners


def test_status_table_and_html(cluster):
    status = cluster.status()
    text = str(status)
    assert text.startswith(f"cluster '{cluster.name}': running, 1 ps + 2 worker task(s), engines: local")
    for record in cluster.tasks:
        assert record.address in text
    html = status._repr_html_()
    assert html.count("<tr>") == 4 and "running" in html
    assert cluster._repr_html_() == html


def test_registry_lists_the_cluster_for_other_processes(cluster, registry_dir):
    out = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "list", "--json"], capture_output=True, text=True, timeout=60,
    )
    records = {r["name"]: r for r in json.loads(out.stdout)}
    record = records[cluster.name]
    assert record["spec"] == cluster.spec_dict
    assert [t["job"] for t in record["tasks"]] == ["ps", "worker", "worker"]
    assert record["owned"] is True and record["engines"] == "local"
    assert (registry_dir / f"{cluster.name}.json").exists()
    plain = subprocess.run([sys.executable, "-m", "workbench.cli", "list"], capture_output=True, text=True, timeout=60)
    line = next(row for row in plain.stdout.splitlines() if row.startswith(cluster.name + " "))
    assert line.split()[:2] == [cluster.name, "running"] and cluster.task("worker:1").address in line


def test_port_taken_between_reservation_and_start_is_retried():
    # A real TF server in a fresh process, started on a port someone else holds.
    busy = socket.socket(socket.AF_INET6)
    busy.bind(("::", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    script = textwrap.dedent(f"""
        import json
        from workbench.cluster.launch import engine_side
        result = engine_side.start_server({{"worker": ["127.0.0.1:{port}"]}}, "worker", 0)
        print("RESULT " + json.dumps(result))
    """)
    try:
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    finally:
        busy.close()
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][0][7:])
    assert result["ok"], result
    assert result["retries"] >= 1
    assert result["address"] != f"127.0.0.1:{port}"
    assert result["devices"] == ["/job:worker/replica:0/task:0/device:CPU:0"]


def test_the_tasks_thread_pools_sleep_when_out_of_work_and_share_the_machines_cores(cluster):
    # Several tasks share the machine's cores: a TensorFlow pool that spins for work burns a core another task needs
    # (bench/training.py measures what it saves). The servers are set so, and so is every context this kernel makes
    # on them (TensorFlow hands the client's config to the tasks with its connection). Each server's intra-op pool
    # takes its share of the cores: a worker's among the 2 workers, the ps's among all 3 tasks on this machine.
    import os

    from tensorflow.python.eager import context

    engines = cluster.client[[r.engine_id for r in cluster.tasks]]
    engines.execute("from workbench.cluster.launch import engine_side as _engine_side\n"
                    "_config = _engine_side._SERVER['server'].server_def.default_session_config\n"
                    "_pools = (_config.experimental.disable_thread_spinning, _config.intra_op_parallelism_threads)",
                    block=True)
    cores = len(os.sched_getaffinity(0))
    shares = [max(1, cores // (3 if r.job == "ps" else 2)) for r in cluster.tasks]
    assert engines.pull("_pools", block=True) == [(True, share) for share in shares]
    cluster.connect()
    assert context.context().get_server_def().default_session_config.experimental.disable_thread_spinning


def test_a_call_on_the_engines_returns_with_the_last_answer_not_at_its_next_look(cluster):
    from workbench.cluster.launch.calls import Deadline, RemoteCallsTimedOut, run_on_engines

    engines = [r.engine_id for r in cluster.tasks]
    slow = {e: (subprocess.getoutput, f"sleep {0.2 * i}; echo {i * i}") for i, e in enumerate(engines)}
    looks = []
    started = time.monotonic()
    # one look an hour between answers: the call still returns when the engines answer, and sees each answer
    results = run_on_engines(cluster.client, slow, Deadline(120), on_progress=lambda done, total: looks.append(done), poll=3600)
    assert results == {e: str(i * i) for i, e in enumerate(engines)}
    assert time.monotonic() - started < 60, "it waited for its next look, not for the answers"
    assert looks[-1] == len(engines) and len(looks) <= 2 * len(engines), looks
    # and the deadline still bounds a wait longer than it
    with pytest.raises(RemoteCallsTimedOut) as raised:
        run_on_engines(cluster.client, {engines[0]: (subprocess.getoutput, "sleep 1")}, Deadline(0.3), poll=3600)
    assert raised.value.pending == [engines[0]]
