"""Attaching to a user's ipyparallel cluster, and the GPU assignment path on a machine without GPUs."""

import os

import psutil
import pytest
from conftest import run_tf_client

import workbench as wb

pytestmark = pytest.mark.cluster


def test_from_existing_borrows_engines_and_leaves_them_running(no_leftover_processes):
    import ipyparallel as ipp

    ipp_cluster = ipp.Cluster(n=3, controller_ip="127.0.0.1", cluster_id="wb-test-user-pool", log_level=40)
    ipp_client = ipp_cluster.start_and_connect_sync()
    try:
        ipp_client.wait_for_engines(3, timeout=120)
        cluster = wb.Cluster.from_existing(ipp_cluster, ps=1, workers=1, name="wb-test-attached", progress=False)
        cluster.start()
        assert [r.name for r in cluster.tasks] == ["ps:0", "worker:0"]
        result = run_tf_client(cluster.spec_dict, """
            with tf.device("/job:worker/replica:0/task:0/device:CPU:0"):
                x = tf.constant(2.0) * 21
            result = {"x": float(x.numpy())}
        """)
        assert result == {"x": 42.0}
        cluster.scale(workers=2)  # takes the idle third engine
        assert len(cluster.spec_dict["worker"]) == 2
        with pytest.raises(wb.ClusterStateError, match="0 idle engine"):
            cluster.start_timeout = 2
            cluster.scale(workers=3)
        assert [r.name for r in cluster.tasks] == ["ps:0", "worker:0", "worker:1"]
        pids = [r.pid for r in cluster.tasks]
        cluster.stop()
        assert all(psutil.pid_exists(pid) for pid in pids), "stop() must not stop borrowed engines"
        assert sorted(ipp_client.ids) == [0, 1, 2]

        # Attaching again with the same roles reuses the servers that kept listening.
        again = wb.Cluster.from_existing(ipp_client, ps=1, workers=1, progress=False).start()
        assert again.spec_dict["ps"] == [cluster.tasks[0].address]
        again.stop()
    finally:
        ipp_client.close()
        ipp_cluster.stop_cluster_sync()


def test_workers_get_disjoint_gpu_lists_and_ps_none(no_leftover_processes):
    # What a scheduler does on a 4-GPU node: it sets CUDA_VISIBLE_DEVICES for the job.
    # This machine has no GPU hardware, so TensorFlow itself sees only CPUs.
    with wb.Cluster(ps=1, workers=2, gpus_per_worker=2, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, progress=False) as cluster:
        gpus = {r.name: r.gpus for r in cluster.tasks}
        assert gpus == {"ps:0": [], "worker:0": ["0", "1"], "worker:1": ["2", "3"]}
        # each engine is a fork of the warm process, which imported TensorFlow without touching a device
        assert len({psutil.Process(r.pid).ppid() for r in cluster.tasks}) == 1
        seen = cluster.client[:].apply_sync(os.getenv, "CUDA_VISIBLE_DEVICES")
        by_engine = dict(zip(cluster.client.ids, seen))
        assert {r.name: by_engine[r.engine_id] for r in cluster.tasks} == {"ps:0": "", "worker:0": "0,1", "worker:1": "2,3"}
        assert "GPUs" in str(cluster.status()) and "0,1" in str(cluster.status())
        with pytest.raises(wb.ConfigurationError, match="need 6 GPU"):
            cluster.scale(workers=3)
