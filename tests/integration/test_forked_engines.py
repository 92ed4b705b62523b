"""Local engines are forks of one warm process that imported TensorFlow; when forking cannot be safe, they are not.

Every test here starts real clusters and checks the process table: who is whose parent, what
runs after stop, and that a refused fork falls back to engines started as new processes, saying why.
"""

import gc
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import psutil
import pytest
from conftest import run_tf_client, wait_gone, warm_children

import workbench as wb
from workbench.cluster.launch.lean_import import LEFT_OUT

pytestmark = pytest.mark.cluster


def _warm_of(cluster) -> psutil.Process:
    parents = {psutil.Process(r.pid).ppid() for r in cluster.tasks}
    assert len(parents) == 1, f"the engines have several parents: {parents}"
    warm = psutil.Process(parents.pop())
    assert "workbench.cluster.launch.warm" in " ".join(warm.cmdline())
    return warm


def _socket_of(warm: psutil.Process) -> str:
    command = warm.cmdline()
    return command[command.index("--socket") + 1]


def _sum_on_each_task(cluster) -> dict:
    return _sum_on_each_task_named(cluster, ["ps:0", "worker:0", "worker:1"])


def _sum_on_each_task_named(cluster, names: list[str]) -> dict:
    return run_tf_client(cluster.spec_dict, """
        result = {}
        for name in NAMES:
            job, index = name.split(":")
            with tf.device(f"/job:{job}/replica:0/task:{index}/device:CPU:0"):
                result[name] = float(tf.reduce_sum(tf.range(1.0, 11.0)).numpy())
    """.replace("NAMES", repr(names)))


def test_engines_and_their_nannies_are_forks_of_one_warm_process(cluster):
    warm = _warm_of(cluster)
    assert warm.ppid() == os.getpid()  # this client started it
    children = {p.pid: " ".join(p.cmdline()) for p in warm.children()}
    for record in cluster.tasks:
        assert "workbench.cluster.launch.engine_main" in children[record.pid]  # forked engines say what they are in ps
        nannies = [c for c in children.values() if f"ipyparallel.engine.nanny [engine pid {record.pid}," in c]
        assert len(nannies) == 1, f"{record.name} has nannies {nannies}"
        # most of a forked engine's memory is the warm process's, shared copy-on-write
        memory = psutil.Process(record.pid).memory_full_info()
        assert memory.uss < memory.rss / 2
    # TensorFlow came with the fork, and the frozen heap with it
    frozen = cluster.client[[r.engine_id for r in cluster.tasks]].apply_sync(gc.get_freeze_count)
    assert min(frozen) > 100_000
    # without what Keras loads for a kernel's sake (lean_import): an engine uses none of it
    companions = _companions_loaded(cluster.client[[r.engine_id for r in cluster.tasks]])
    assert companions == [[]] * len(cluster.tasks), companions
    assert _sum_on_each_task(cluster) == {"ps:0": 55.0, "worker:0": 55.0, "worker:1": 55.0}


def test_scaling_forks_from_the_same_warm_process_and_stop_leaves_only_it_for_the_next_cluster(no_leftover_processes):
    from workbench.cluster.launch.fork_launcher import kept_warm

    with wb.Cluster(ps=0, workers=1, name="wb-test-fork-scale", progress=False) as cluster:
        warm = _warm_of(cluster)
        cluster.scale(workers=3)
        assert _warm_of(cluster).pid == warm.pid
        assert len(cluster.tasks) == 3
        forks = [p.pid for p in warm.children(recursive=True)]
    assert not wait_gone(forks, timeout=30), "a fork of the warm process outlived stop()"
    assert kept_warm.pid == warm.pid and warm.children() == []  # kept, forking nothing
    directory = os.path.dirname(_socket_of(warm))
    with wb.Cluster(ps=0, workers=1, name="wb-test-fork-next", progress=False) as cluster:
        assert _warm_of(cluster).pid == warm.pid  # the next cluster's engines are its forks: no second import
        assert kept_warm.pid is None  # taken: in use, not kept
        assert _sum_on_each_task_named(cluster, ["worker:0"]) == {"worker:0": 55.0}
    assert kept_warm.pid == warm.pid  # kept again
    with wb.Cluster(ps=0, workers=1, env={"OMP_NUM_THREADS": "1"}, name="wb-test-fork-other", progress=False) as other:
        assert _warm_of(other).pid != warm.pid  # read when TensorFlow loads: its own warm process
        assert not wait_gone([warm.pid], timeout=10), "two idle TensorFlow imports: the kept one was not stopped"
        assert not os.path.exists(directory)
        other_warm = _warm_of(other)
    assert kept_warm.pid == other_warm.pid
    kept_warm.release()
    assert not wait_gone([other_warm.pid], timeout=10), "release() left the kept warm process running"


def test_a_kept_warm_process_exits_when_no_cluster_comes_and_with_its_client(no_leftover_processes):
    from workbench.cluster.launch.fork_launcher import WarmProcess

    warm = WarmProcess.start(dict(os.environ))
    try:
        assert warm.status(timeout=120)["fork_problem"] == ""
        assert warm.keep(2.0)
        assert warm.usable()  # asked again in time: in use, no exit
        assert wait_gone([warm.pid], timeout=4) == {warm.pid}
        assert warm.keep(0.5)
        assert not wait_gone([warm.pid], timeout=15), "a kept warm process outlived its keep time"
        assert not os.path.exists(os.path.dirname(warm.socket_path))  # it removed its directory
        assert not warm.usable()
    finally:
        warm.close()
    client = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import workbench as wb
        from workbench.cluster.launch.fork_launcher import kept_warm
        wb.Cluster(ps=0, workers=1, name="wb-test-kept-exit", progress=False).start().stop()
        print(kept_warm.pid, kept_warm._warm.socket_path)
    """)], capture_output=True, text=True, timeout=180)
    assert client.returncode == 0, client.stderr[-3000:]
    pid, socket_path = client.stdout.split()
    assert not wait_gone([int(pid)], timeout=15), "the kept warm process outlived its client"
    assert not os.path.exists(os.path.dirname(socket_path))


def test_engines_added_after_a_job_are_still_forks(monkeypatch, no_leftover_processes):
    from training_helpers import train

    from workbench.cluster.process.connection import CLIENT_ENVIRONMENT

    for name in CLIENT_ENVIRONMENT:  # as in a fresh kernel: its first connection (the job below) sets them
        monkeypatch.delenv(name, raising=False)
    with wb.Cluster(ps=1, workers=1, name="wb-test-fork-after-job", progress=False) as cluster:
        warm = _warm_of(cluster)
        assert train(cluster, steps=20, batch_size=60).wait(120).state == "finished"
        assert all(name in os.environ for name in CLIENT_ENVIRONMENT)  # the kernel is a client now
        with warnings.catch_warnings():
            warnings.simplefilter("error", wb.EngineForkWarning)  # the client's settings cost no fork
            cluster.scale(workers=2)
        assert _warm_of(cluster).pid == warm.pid
        forks = [p.pid for p in warm.children(recursive=True)]
    assert not wait_gone(forks, timeout=30), "a fork of the warm process outlived stop()"


def test_plain_ipyparallel_can_fork_engines_by_launcher_name(no_leftover_processes):
    import ipyparallel as ipp

    ipp_cluster = ipp.Cluster(engines="workbench-fork", n=2, controller_ip="127.0.0.1", cluster_id="wb-test-ipp-fork", log_level=40)
    client = ipp_cluster.start_and_connect_sync()
    try:
        client.wait_for_engines(2, timeout=120)
        pids = client[:].apply_sync(os.getpid)
        parents = {psutil.Process(pid).ppid() for pid in pids}
        assert len(parents) == 1 and "workbench.cluster.launch.warm" in " ".join(psutil.Process(parents.pop()).cmdline())
        client[:].execute("import sys; has_tensorflow = 'tensorflow' in sys.modules", block=True)
        assert client[:].pull("has_tensorflow", block=True) == [True, True]
        for pid in pids:  # the launcher's own warm process loaded the bind shim, so its forks have it
            assert "workbench-bind-shim" in Path(f"/proc/{pid}/maps").read_text()
    finally:
        client.close()
        ipp_cluster.stop_cluster_sync()  # the launcher stops the warm process it started


def test_fork_false_starts_each_engine_as_a_new_python(no_leftover_processes):
    warm_before = warm_children()  # the shared session cluster's, if it runs
    with warnings.catch_warnings():
        warnings.simplefilter("error", wb.EngineForkWarning)  # an explicit choice is no fallback: no notice
        with wb.Cluster(ps=0, workers=1, fork=False, name="wb-test-no-fork", progress=False) as cluster:
            engine = psutil.Process(cluster.tasks[0].pid)
            assert engine.ppid() == os.getpid()
            assert warm_children() == warm_before  # no warm process was started
            # its own import of TensorFlow left them out too; a user's code still imports them
            view = cluster.client[cluster.tasks[0].engine_id]
            assert _companions_loaded(view) == []
            view.execute("import pandas, sklearn.preprocessing; found = [pandas.__name__, sklearn.__name__]", block=True)
            assert view.pull("found", block=True) == ["pandas", "sklearn"]


def _companions_loaded(view) -> list:
    """On each engine of ``view``, once it imported TensorFlow: which of Keras's optional companions it loaded."""
    view.execute("import sys, tensorflow\n"  # waits for an engine's own import in progress
                 f"companions = [name for name in {LEFT_OUT!r} if name in sys.modules]", block=True)
    return view.pull("companions", block=True)


def _preload_module(tmp_path, name: str, body: str) -> dict:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    return {"env": {"PYTHONPATH": str(tmp_path)}, "preload": [name]}


def _starts_without_forking(options: dict, reason: str, scale: bool) -> None:
    """A cluster whose warm process refuses to fork for ``reason`` starts its engines as new Pythons, said once
    (with ``scale``: scaling adds more without a second notice; the refusal's reason does not change that)."""
    warm_before = warm_children()
    with pytest.warns(wb.EngineForkWarning, match=reason) as caught:
        cluster = wb.Cluster(ps=0, workers=1, progress=False, **options).start()
    try:
        # one line saying why (pytest.warns records every warning: a garbage-collected socket's too)
        (said,) = [str(w.message) for w in caught if issubclass(w.category, wb.EngineForkWarning)]
        assert "\n" not in said
        assert psutil.Process(cluster.tasks[0].pid).ppid() == os.getpid()  # a new process, not a fork
        assert not warm_children() - warm_before  # the warm process that refused was stopped: its memory is back
        assert cluster.tasks[0].state == "running"
        if not scale:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("error", wb.EngineForkWarning)
            cluster.scale(workers=2)  # said once: scaling adds new processes without a second notice
        assert psutil.Process(cluster.tasks[1].pid).ppid() == os.getpid()
    finally:
        cluster.stop()


def test_a_warm_process_running_threads_refuses_to_fork(tmp_path, no_leftover_processes):
    options = _preload_module(tmp_path, "starts_a_thread", """
        import threading, time
        threading.Thread(target=time.sleep, args=(3600,), name="user-poller", daemon=True).start()
    """)
    _starts_without_forking(options, r"warm process runs 2 threads \(also: user-poller\)", scale=True)


def test_a_gpu_driver_loaded_in_the_warm_process_refuses_to_fork(tmp_path, no_leftover_processes):
    # What a GPU build of TensorFlow would do if it initialised CUDA at import: a library named like
    # NVIDIA's driver mapped into the warm process (any shared library will do for the name).
    import _json

    shutil.copy(_json.__file__, tmp_path / "libcuda.so.1")
    options = _preload_module(tmp_path, "loads_a_gpu_driver", f"""
        import ctypes
        ctypes.CDLL({str(tmp_path / "libcuda.so.1")!r})
    """)
    _starts_without_forking(options, r"GPU driver \(.*libcuda\.so\.1\) was loaded in the warm process", scale=False)
