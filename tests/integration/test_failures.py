"""Start-up failures give clear errors and leave nothing running; so does a killed client."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from conftest import read_line, wait_gone

import workbench as wb

pytestmark = pytest.mark.cluster


def _fake_tensorflow(tmp_path, body):
    package = tmp_path / "fake" / "tensorflow"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(body))
    return str(tmp_path / "fake")


def test_engine_that_cannot_import_tensorflow(tmp_path, no_leftover_processes):
    path = _fake_tensorflow(tmp_path, "raise ImportError('libtensorflow_framework.so.2: cannot open shared object file')\n")
    cluster = wb.Cluster(ps=0, workers=1, env={"PYTHONPATH": path}, progress=False, start_timeout=120)
    with pytest.raises(wb.TensorFlowImportError) as info:
        cluster.start()
    message = str(info.value)
    assert "engine 0 (" in message and "could not import TensorFlow" in message
    assert "libtensorflow_framework.so.2" in message and "pip install 'jupyter-tf-workbench[cpu]'" in message
    assert cluster.state == "failed"


def test_engine_with_another_tensorflow_version(tmp_path, no_leftover_processes):
    path = _fake_tensorflow(tmp_path, "__version__ = '2.0.0-fake'\n")
    cluster = wb.Cluster(ps=0, workers=1, env={"PYTHONPATH": path}, progress=False, start_timeout=120)
    with pytest.raises(wb.VersionMismatchError, match=r"engine 0 \(.*\) runs TensorFlow 2.0.0-fake but this client runs 2\."):
        cluster.start()


def test_a_thread_setting_that_is_neither_yes_nor_no_stops_the_start_with_what_to_set(no_leftover_processes):
    cluster = wb.Cluster(ps=0, workers=1, env={"WORKBENCH_THREAD_SPINNING": "maybe"}, progress=False, start_timeout=120)
    with pytest.raises(wb.ServerStartError, match=r"WORKBENCH_THREAD_SPINNING='maybe' is not understood: set it to 1"):
        cluster.start()
    assert cluster.state == "failed"


def test_engines_that_die_at_start_report_the_launchers_log(no_leftover_processes):
    crash = [sys.executable, "-c", "import sys; print('engine: cannot find the scratch filesystem'); sys.exit(3)"]
    cluster = wb.Cluster(ps=1, workers=1, engine_cmd=crash, progress=False, start_timeout=60)
    started = time.monotonic()
    with pytest.raises(wb.EngineStartTimeout) as info:
        cluster.start()
    assert time.monotonic() - started < 50, "a launcher that stopped should fail fast, not wait for the timeout"
    message = str(info.value)
    assert "only 0 of 2 engine(s) registered (the engine launcher stopped)" in message
    assert "cannot find the scratch filesystem" in message


def test_a_starting_cluster_is_listed_as_starting_and_a_failed_start_leaves_no_record(no_leftover_processes,
                                                                                      registry_dir):
    from workbench.cluster import registry

    crash = [sys.executable, "-c", "import sys, time; time.sleep(2); sys.exit(3)"]
    cluster = wb.Cluster(ps=0, workers=1, engine_cmd=crash, progress=False, start_timeout=60, name="wb-test-starting")
    failed = []
    starting = threading.Thread(target=lambda: failed.append(pytest.raises(wb.EngineStartTimeout, cluster.start)))
    starting.start()
    seen = None
    for _ in range(200):  # at most 20 s
        record = registry.read_record("wb-test-starting")
        if record is not None:
            seen = record.state
            break
        time.sleep(0.1)
    with pytest.raises(wb.ClusterStateError, match="is starting"):
        wb.attach("wb-test-starting", timeout=0.5)  # waited for, then a clear error
    starting.join(90)
    assert seen == "starting" and failed, (seen, failed)  # the panel saw it while it started
    assert registry.read_record("wb-test-starting") is None  # and nothing is left of it


def test_engines_that_never_register_time_out_and_are_stopped(no_leftover_processes):
    hang = [sys.executable, "-c", "import time; print('engine: waiting for a licence server'); time.sleep(600)"]
    cluster = wb.Cluster(ps=0, workers=2, engine_cmd=hang, progress=False, start_timeout=8)
    with pytest.raises(wb.EngineStartTimeout) as info:
        cluster.start()
    message = str(info.value)
    assert "only 0 of 2 engine(s) registered (within 8 s)" in message
    assert "waiting for a licence server" in message and "start_timeout" in message


CLIENT = textwrap.dedent("""
    import json, sys, time
    import psutil
    import workbench as wb
    cluster = wb.Cluster(ps=1, workers=1, name="wb-test-sigkill", progress=False).start()
    pids = set()
    for proc in psutil.Process().children(recursive=True):
        pids.add(proc.pid)
    print("SCRATCH " + cluster.pool.scratch, flush=True)
    print("PIDS " + json.dumps(sorted(pids)), flush=True)
    time.sleep(600)
""")


def test_killed_client_leaves_no_engine_controller_or_registry_file(registry_dir):
    client = subprocess.Popen([sys.executable, "-c", CLIENT], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        line, scratch = "", ""
        while not line.startswith("PIDS ") and time.monotonic() < deadline:
            line = read_line(client, max(1.0, deadline - time.monotonic()), "its cluster's PIDS")
            assert line or client.poll() is None, "client exited before its cluster started"
            scratch = line[len("SCRATCH "):].strip() if line.startswith("SCRATCH ") else scratch
        pids = json.loads(line[5:])
        assert scratch and os.path.isdir(scratch)  # the engines' temporary directory
        names = [" ".join(psutil.Process(p).cmdline()) for p in pids]
        assert any("ipyparallel.controller" in n for n in names)
        assert sum("workbench.cluster.launch.engine_main" in n for n in names) == 2
        assert any("workbench.cluster.launch.warm" in n for n in names)  # the engines' parent: it must go too
        assert sum("ipyparallel.engine.nanny" in n for n in names) == 2
        assert any("workbench.cluster.launch.reaper" in n for n in names)
        assert (registry_dir / "wb-test-sigkill.json").exists()
    except BaseException:
        client.kill()
        raise
    client.send_signal(signal.SIGKILL)
    client.wait(timeout=10)
    alive = wait_gone(pids, timeout=60)
    assert not alive, f"still running 60 s after the client was killed: {alive}"
    assert not (registry_dir / "wb-test-sigkill.json").exists()
    assert not os.path.exists(scratch), "the reaper left the cluster's temporary directory"


def test_engines_exit_on_their_own_when_the_lifeline_closes(no_leftover_processes):
    """The engine-side half of the guarantee, for engines the reaper cannot reach (other hosts)."""
    cluster = wb.Cluster(ps=0, workers=1, name="wb-test-lifeline", progress=False).start()
    try:
        engine = psutil.Process(cluster.tasks[0].pid)
        reaper = cluster.pool._reaper
        # Kill the reaper alone, as if the client's host vanished: nobody kills the engine for it.
        os.kill(reaper.pid, signal.SIGKILL)
        engine.wait(timeout=30)
    finally:
        cluster.stop()
