"""engines="slurm" against a real single-node Slurm (tests/slurm.py): start, train, scale, stop, and a job that waits.

Runs as root (CI does); otherwise skipped with the reason. The Slurm daemons are started by a
module fixture and stopped after the module, and every test checks that it left nothing queued.
"""

from __future__ import annotations

import os
import re
import time
import warnings

import pytest
import slurm
from training_helpers import STEPS_OF_A_MECHANIC, assert_trained, train

import workbench as wb

pytestmark = pytest.mark.usefixtures("no_leftover_processes")
QUEUE_EMPTY_SECONDS = 30


@pytest.fixture(scope="module")
def local_slurm():
    reason = slurm.available()
    if reason:
        pytest.skip(reason)
    with slurm.running(cpus=16) as cluster:  # the launcher's sbatch/scancel, and the workbench's squeue, find it
        yield cluster


def _queue_empties(local_slurm) -> list[str]:
    deadline = time.monotonic() + QUEUE_EMPTY_SECONDS
    while (jobs := local_slurm.jobs()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return jobs


def test_a_slurm_cluster_trains_scales_and_leaves_the_queue_empty(local_slurm):
    with warnings.catch_warnings():
        warnings.simplefilter("error", wb.ExposedPortsWarning)  # tasks bind the controller's address only
        cluster = wb.Cluster(ps=1, workers=2, engines="slurm", controller_ip="127.0.0.1", progress=False,
                             start_timeout=120, name="wb-test-slurm")
        cluster.start()
    try:
        jobs = local_slurm.jobs()
        assert len(jobs) == 1 and " RUNNING " in f" {jobs[0]} ", jobs
        status = cluster.status()
        assert "engines: slurm" in str(status) and {t.name for t in status.tasks} == {"ps:0", "worker:0", "worker:1"}
        assert all(address.startswith("127.0.0.1:") for job in cluster.spec_dict.values() for address in job)

        for strategy in ("async-ps", "allreduce"):
            job = train(cluster, strategy=strategy, steps=STEPS_OF_A_MECHANIC).wait(300)
            assert_trained(job, STEPS_OF_A_MECHANIC, {"worker:0", "worker:1"})

        cluster.scale(workers=3)
        assert len(cluster.spec_dict["worker"]) == 3
        cluster.scale(workers=2)
        assert len(cluster.spec_dict["worker"]) == 2
        job = train(cluster, steps=100).wait(300)
        assert job.state == "finished"
        batch_file = cluster.pool.batch_file
        assert os.path.exists(batch_file) and not os.path.exists("slurm_engine.sbatch")  # not in the user's directory
    finally:
        cluster.stop()
    assert _queue_empties(local_slurm) == [], "Slurm jobs left after stop()"
    assert not os.path.exists(batch_file)


def test_a_job_left_pending_ends_in_a_timeout_that_names_it_and_is_cancelled(local_slurm):
    """Another job holds every CPU of the node: the cluster's job waits (PENDING, reason Resources)."""
    submitted = local_slurm.run("sbatch", "--parsable", "-c", str(local_slurm.cpus), "-o", "/dev/null",
                                "--wrap", "sleep 600")
    blocker = submitted.stdout.strip().split(";")[0]
    assert submitted.returncode == 0 and blocker.isdigit(), submitted.stderr
    try:
        cluster = wb.Cluster(ps=1, workers=2, engines="slurm", controller_ip="127.0.0.1", progress=False,
                             start_timeout=15, name="wb-test-slurm-pending")
        with pytest.raises(wb.EngineStartTimeout, match=r"Batch job (\d+) is PENDING \(reason: Resources\)") as caught:
            cluster.start()
        waiting = re.search(r"Batch job (\d+)", str(caught.value)).group(1)
        assert waiting != blocker and "start_timeout" in str(caught.value)
        assert all(not line.startswith(f"{waiting} ") for line in local_slurm.jobs()), "the pending job was not cancelled"
    finally:
        local_slurm.run("scancel", blocker)
    assert _queue_empties(local_slurm) == []
