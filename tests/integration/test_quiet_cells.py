"""Cells show what the user asked for: no TensorFlow, absl or gRPC log line; the workbench's own notices stay.

A real Jupyter kernel runs a cluster, trains, loses a worker (gRPC's "Failed to connect" blocks) and stops
(variables freed as the tasks go): every stderr line its cells received is checked.
"""

import os
import re
import textwrap
from pathlib import Path

import pytest
from jupyter_client import KernelManager
from jupyter_helpers import start_kernel

pytestmark = pytest.mark.cluster

NATIVE = re.compile(r"^[IWEF]\d{4} |absl::|GRPC|grpc_|oneDNN|cpu_feature_guard|rebuild TensorFlow|EagerResourceDeleter")

CELLS = [
    "import os, signal, keras, workbench as wb\nimport tensorflow as tf",
    "cluster = wb.Cluster(ps=1, workers=2, name='wb-test-quiet', progress=False).start()",
    "with cluster.device('worker:0'):\n    total = int(tf.reduce_sum(tf.range(10)))\ntotal",
    textwrap.dedent("""\
        def make_model():
            return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation='relu'), keras.layers.Dense(10)])
        job = wb.train(cluster, make_model, wb.datasets.digits, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                       steps=400)
        import time
        while job.steps_done < 20 and job.state == 'running':
            time.sleep(0.05)
        os.kill(cluster.task('worker:1').pid, signal.SIGKILL)
        job.wait(300)
        job.state, job.steps_done"""),
    "cluster.stop()",
    "wb.native_logs.log_path()",
    "print(cluster.log_path)\nprint(str(cluster.status()).splitlines()[-1])",
]


@pytest.mark.parametrize("kernel, first_cell", [
    ("workbench", CELLS[0]),  # the tutorials' kernel: quiet from its start, whatever is imported first
    ("python3", "import workbench as wb\nimport os, signal, keras\nimport tensorflow as tf"),  # any kernel, workbench first
])
def test_a_kernels_cells_get_no_native_log_line_and_the_log_file_gets_them(kernel, first_cell, tmp_path,
                                                                           no_leftover_processes):
    # as users have it: the suite quiets TensorFlow itself, and ipykernel does not capture descriptor 2 under pytest
    as_users_have_it = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "PYTEST_CURRENT_TEST")}
    manager, client = start_kernel(lambda: KernelManager(kernel_name=kernel),
                                   env={**as_users_have_it, "WORKBENCH_CACHE_DIR": str(tmp_path)})
    stderr, stdout, results = [], [], []
    try:
        for cell in [first_cell, *CELLS[1:]]:
            outputs = []
            reply = client.execute_interactive(cell, timeout=400, output_hook=outputs.append)
            assert reply["content"]["status"] == "ok", (cell, reply["content"], outputs)
            stderr += [line for m in outputs if m["msg_type"] == "stream" and m["content"]["name"] == "stderr"
                       for line in m["content"]["text"].splitlines() if line.strip()]
            results += [m["content"]["data"]["text/plain"] for m in outputs if m["msg_type"] == "execute_result"]
            stdout += [line for m in outputs if m["msg_type"] == "stream" and m["content"]["name"] == "stdout"
                       for line in m["content"]["text"].splitlines() if line.strip()]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)
    noise = [line for line in stderr if NATIVE.search(line)]
    assert noise == [], f"{len(noise)} native log lines reached the cells, e.g. {noise[:5]}"
    assert results[:2] == ["45", "('finished', 400)"]
    assert any("TaskFaultWarning" in line and "worker:1" in line and "job async-ps" in line for line in stderr), stderr
    assert not any("recovery.py" in line or "self.say(" in line for line in stderr), stderr  # no library source lines
    # from the first connection on, the kernel's lines go to the cluster's own log file, which status() names
    log = Path(results[2].strip("'"))
    assert stdout[-2:] == [str(log), f"native logs: {log}"], stdout
    assert log.parent == tmp_path / "logs" and log.name.startswith("cluster-wb-test-quiet-"), log
    text = log.read_text()
    assert "connects to cluster 'wb-test-quiet'" in text and NATIVE.search(text), "the native lines went nowhere"


SCRIPT = textwrap.dedent("""\
    import os, signal, sys, time, keras, workbench as wb
    cluster = wb.Cluster(ps=1, workers=3, name='wb-test-quiet-script', progress=False).start()
    def make_model():
        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation='relu'), keras.layers.Dense(10)])
    job = wb.train(cluster, make_model, wb.datasets.digits, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   steps=100000, batch_size=96, strategy=wb.AsyncPS(elastic_batch='per-worker'))
    job.wait_set_up()
    print('CONNECTED', file=sys.stderr, flush=True)
    while job.steps_done < 50 and job.state == 'running':
        time.sleep(0.05)
    os.kill(cluster.task('worker:1').pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while (cluster.task('worker:1').restarts < 1 or cluster.task('worker:1').state != 'running') and time.monotonic() < deadline:
        time.sleep(0.05)  # re-hosted (its old record still says running until the kill is noticed)
    cluster.scale(workers=2)
    job.stop()
    cluster.stop()
    from workbench.cluster.machine.memory import malloc_arenas
    print(job.state, len(job.events), cluster.log_path, malloc_arenas())
""")


def test_a_plain_script_that_loses_and_scales_a_task_prints_only_the_workbenchs_own_lines(tmp_path, no_leftover_processes):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "WORKBENCH_NATIVE_LOGS")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    state, events, log, heaps = done.stdout.split()[-4:]
    assert state == "cancelled" and events == "1", done.stdout
    assert int(heaps) <= 3, heaps  # the client's threads shared the heaps made before the import (16 without the cap)
    after = done.stderr.split("CONNECTED\n", 1)[1].splitlines()
    assert not [line for line in after if NATIVE.search(line)], after  # the lost task's and the scale's lines went...
    assert any("re-hosting" in line for line in after), after  # ...while the workbench's own notices stay
    assert NATIVE.search(Path(log).read_text()), log  # ...to the cluster's log file
