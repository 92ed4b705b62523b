"""Start, scale and stop own their processes: nothing is left behind."""

import asyncio
import contextlib
import os
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import run_tf_client, wait_gone

import workbench as wb

pytestmark = pytest.mark.cluster


def _tree(pids):
    found = set()
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            found |= {proc.pid} | {c.pid for c in proc.children(recursive=True)}
        except psutil.Error:
            pass
    return found


def test_scale_stop_and_context_manager(no_leftover_processes, registry_dir):
    with wb.Cluster(ps=1, workers=1, name="wb-test-scale", progress=False) as cluster:
        assert cluster.state == "running"
        cluster.scale(workers=3)
        assert [r.name for r in cluster.tasks] == ["ps:0", "worker:0", "worker:1", "worker:2"]
        assert len(cluster.spec_dict["worker"]) == 3
        result = run_tf_client(cluster.spec_dict, """
            with tf.device("/job:worker/replica:0/task:2/device:CPU:0"):
                x = tf.reduce_sum(tf.ones([4, 4]))
            result = {"sum": float(x.numpy()), "device": x.device}
        """)
        assert result == {"sum": 16.0, "device": "/job:worker/replica:0/task:2/device:CPU:0"}

        removed = cluster.task("worker:2")
        removed_tree = _tree([removed.pid])
        cluster.scale(workers=2)
        assert [r.name for r in cluster.tasks] == ["ps:0", "worker:0", "worker:1"]
        assert not wait_gone(removed_tree, timeout=30), "the removed worker's engine is still running"
        assert removed.engine_id not in cluster.client.ids

        with pytest.raises(wb.ConfigurationError, match="number of ps tasks cannot change"):
            cluster.scale(ps=2)
        with pytest.raises(wb.ConfigurationError, match="at least one worker"):
            cluster.scale(workers=0)

        # a second cluster of the same name is refused before it starts anything; the first keeps running
        with pytest.raises(wb.ClusterStartError, match="'wb-test-scale' is already running.*another name"):
            wb.Cluster(ps=1, workers=1, name="wb-test-scale", progress=False).start()
        assert cluster.client.ids and cluster.state == "running"

        everything = _tree([r.pid for r in cluster.tasks])
        assert (registry_dir / "wb-test-scale.json").exists()
    assert cluster.state == "stopped"
    assert all(r.state == "stopped" for r in cluster.tasks)
    assert not wait_gone(everything, timeout=30)
    assert not (registry_dir / "wb-test-scale.json").exists()
    cluster.stop()  # a second stop is harmless
    with pytest.raises(wb.ClusterStateError, match="stopped"):
        cluster.start()


def test_a_controller_of_the_same_id_started_elsewhere_is_refused_and_left_alone(no_leftover_processes):
    import ipyparallel as ipp

    foreign = ipp.Cluster(cluster_id="wb-test-foreign", n=0, log_level=40)
    foreign.start_controller_sync()
    try:
        foreign.connect_client_sync().close()  # the controller is up: its connection files are written
        files = [foreign.cluster_file, *foreign.controller.connection_files.values()]
        with pytest.raises(wb.ClusterStartError, match="controller for cluster id 'wb-test-foreign' is already running"):
            wb.Cluster(ps=1, workers=1, name="wb-test-foreign", progress=False).start()
        # the refused start removed none of the running controller's files, and a client still connects to it
        assert [f for f in files if not Path(f).exists()] == []
        with foreign.connect_client_sync() as client:
            assert client.ids == []
    finally:
        foreign.stop_cluster_sync()


def test_engines_write_temporary_files_in_the_clusters_own_directory_removed_at_stop(no_leftover_processes):
    """Forked engines end without exit handlers, so what TensorFlow's autograph wrote there was never removed:
    it goes to the cluster's directory instead, and that goes at stop. The next cluster, forked from the warm
    process the first one kept, writes in its own."""
    import tempfile

    for name in ("wb-test-scratch", "wb-test-scratch-next"):
        cluster = wb.Cluster(ps=0, workers=1, name=name, progress=False).start()
        try:
            scratch = cluster.pool.scratch
            engine = cluster.client[cluster.task("worker:0").engine_id]
            assert engine.apply_sync(tempfile.gettempdir) == scratch
            assert os.path.dirname(scratch) == tempfile.gettempdir()
            assert cluster.scratch == scratch
        finally:
            cluster.stop()
        assert not os.path.exists(scratch)


def test_ipyparallels_own_panel_does_not_list_a_workbench_cluster(no_leftover_processes):
    """Its stop button would stop the controller behind the workbench's back: the workbench's panel lists it."""
    from ipyparallel.cluster.cluster import ClusterManager

    from workbench.cluster import registry

    with wb.Cluster(ps=0, workers=1, name="wb-test-hidden", progress=False) as cluster:
        manager = ClusterManager()
        manager.load_clusters()  # what ipyparallel's JupyterLab panel shows
        assert not [key for key in manager.clusters if key.endswith(":wb-test-hidden")], sorted(manager.clusters)
        recorded = registry.read_record(cluster.name).cluster_file
        assert Path(recorded).exists() and Path(recorded).name == "workbench-cluster-wb-test-hidden.json"
    assert not Path(recorded).exists()


def _hold(name: str, seconds: float, held: list, release: threading.Event) -> None:
    """Stop this process's controller of cluster ``name`` once it has written its connection file, for ``seconds`` or
    until ``release`` is set."""
    from IPython.paths import get_ipython_dir

    written = Path(get_ipython_dir(), "profile_default", "security", f"ipcontroller-{name}-client.json")
    me = psutil.Process()
    for _ in range(6000):  # bounded: 120 s at 0.01 s
        if written.exists():
            for child in me.children(recursive=True):
                try:
                    if not any("ipyparallel.controller" in part for part in child.cmdline()):
                        continue
                    child.suspend()
                except psutil.Error:
                    continue
                held.append(child.pid)
                release.wait(seconds)
                with contextlib.suppress(psutil.Error):  # a failed start may have stopped it meanwhile
                    child.resume()
                return
        time.sleep(0.01)


@contextlib.contextmanager
def _controller_held(monkeypatch, name: str, seconds: float):
    """The controller of cluster ``name`` stopped from when it has written its connection file for ``seconds``, or until
    the block ends if sooner: a controller slow to answer, as on a machine whose cores are all busy. The client asks
    the hub only once the controller is held (left to chance, a client that asked first was answered, and the start
    went on). Yields the pids held."""
    from ipyparallel import Cluster as IPPCluster

    held: list[int] = []
    release = threading.Event()
    holder = threading.Thread(target=_hold, args=(name, seconds, held, release), daemon=True)
    ask = IPPCluster.connect_client

    async def ask_once_held(self, **kwargs):
        for _ in range(1000):  # bounded: 10 s
            if held or not holder.is_alive():
                break
            await asyncio.sleep(0.01)
        assert held, f"the controller of {name!r} was never seen, so never held"
        return await ask(self, **kwargs)

    monkeypatch.setattr(IPPCluster, "connect_client", ask_once_held)
    holder.start()
    try:
        yield held
    finally:
        release.set()
        holder.join(timeout=60)  # it lets the controller go; a failed start stopped it, or it stops with its cluster


def test_a_controller_slow_to_answer_gets_the_starts_time_not_ipyparallels_ten_seconds(no_leftover_processes, monkeypatch):
    with _controller_held(monkeypatch, "wb-test-slow-hub", 12.0) as held, \
            wb.Cluster(ps=1, workers=1, name="wb-test-slow-hub", progress=False, start_timeout=120) as cluster:
        assert held
        assert cluster.state == "running" and len(cluster.tasks) == 2


def test_a_controller_that_never_answers_fails_the_start_saying_what_became_of_it(no_leftover_processes, monkeypatch):
    cluster = wb.Cluster(ps=1, workers=1, name="wb-test-mute-hub", progress=False, start_timeout=12)
    try:
        # Held until the start has failed, however late the client asks: the hub always gets 10 s from the ask, so a
        # hold of a fixed 16 s ended in time for it when the start reached the client over 6 s after the hold began.
        with _controller_held(monkeypatch, "wb-test-mute-hub", 120.0), \
                pytest.raises(wb.ClusterStartError, match=r"hub did not answer the client within \d+ s .*the controller "
                                                          r"\(pid \d+\) is stopped\. Last lines of its log"):
            cluster.start()
    finally:
        cluster.stop()  # nothing to do after the failed start; a start that went on would leave its processes otherwise
