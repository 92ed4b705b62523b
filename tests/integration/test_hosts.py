"""One cluster spread over three emulated hosts (tests/hosts.py: network namespaces on a bridge, an sshd in each).

The kernel and the controller are the head node (the bridge's address); engines start in the hosts
over SSH. Checked: ClusterSpec addresses are the hosts' own, TensorFlow traffic crosses the bridge,
the controller and the lifelines work across hosts, training converges, ``status()`` names the
hosts, and a host whose every process is killed is detected, reported and recovered: its task is
re-hosted on another host and the job finishes. Runs as root (CI does); skipped with the reason
otherwise.
"""

from __future__ import annotations

import os
import sys
import warnings

import hosts
import pytest
from training_helpers import train, wait_for

import workbench as wb

pytestmark = pytest.mark.usefixtures("no_leftover_processes")
RECOVERY_SECONDS = 120


def _hosts(env: dict[str, str] | None = None):
    reason = hosts.available()
    if reason:
        pytest.skip(reason)
    made = hosts.EmulatedHosts(3, env=env)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def emulated():
    yield from _hosts()


@pytest.fixture
def four_gpus_each():
    """Three hosts whose sessions see CUDA_VISIBLE_DEVICES=0,1,2,3, as a scheduler sets on a 4-GPU node."""
    yield from _hosts({"CUDA_VISIBLE_DEVICES": "0,1,2,3"})


def _cluster(emulated, slots: int, name: str, **options) -> wb.Cluster:
    options = {"ps": 1, "workers": 2, "hosts": {h.ssh_host: slots for h in emulated.hosts}, **options}
    return wb.Cluster(engines="ssh",
                      controller_ip=emulated.head, ssh_args=emulated.ssh_args, scp_args=emulated.ssh_args,
                      remote_python=sys.executable, remote_profile_dir=str(emulated.hosts[0].sshd.dir / "profile"),
                      progress=False, start_timeout=120, name=name, **options)


# ipyparallel's thread watching each engine over SSH died with a traceback when the host stopped answering;
# in a notebook it printed in whatever cell ran (launch/ssh.py)
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_cluster_over_three_hosts_trains_across_the_bridge_and_recovers_a_lost_host(emulated):
    with warnings.catch_warnings():
        warnings.simplefilter("error", wb.ExposedPortsWarning)  # every task binds its host's address only
        cluster = _cluster(emulated, slots=2, name="wb-test-hosts").start()
    try:
        status = cluster.status()
        by_task = {t.name: t for t in status.tasks}
        assert [by_task[n].host for n in ("ps:0", "worker:0", "worker:1")] == ["host1", "host2", "host3"], str(status)
        assert "host1" in str(status) and "host3" in str(status)
        addresses = {h.address for h in emulated.hosts}
        assert {a.rpartition(":")[0] for job in cluster.spec_dict.values() for a in job} == addresses

        before = emulated.bridge_bytes()
        job = train(cluster, steps=3000, strategy=wb.AsyncPS(steps_per_call=5))
        wait_for(lambda: job.steps_done >= 300 or job.state != "running", 120, "300 steps")
        assert emulated.bridge_bytes() - before > 1_000_000  # parameters and gradients went between hosts
        lost_host = emulated.hosts[2]  # worker:1's
        assert emulated.kill(lost_host)
        wait_for(lambda: cluster.task("worker:1").state != "running", 30, "worker:1 reported lost")
        wait_for(lambda: cluster.task("worker:1").state == "running" and cluster.task("worker:1").restarts == 1,
                  RECOVERY_SECONDS, "worker:1 re-hosted")
        moved = cluster.task("worker:1")
        assert moved.host in ("host1", "host2") and not moved.address.startswith(lost_host.address + ":")
        assert "re-hosted 1x" in str(cluster.status())

        job.wait(300)
        assert job.state == "finished" and job.steps_done == 3000
        assert [(f["task"], f["action"]) for f in job.faults] == [("worker:1", "re-hosted")]
        assert job.evaluate(wb.datasets.digits_test)["accuracy"] >= 0.9
    finally:
        cluster.stop()


def test_a_start_no_host_can_take_says_which_hosts_and_why(emulated):
    emulated.kill(emulated.hosts[2])
    cluster = _cluster(emulated, slots=1, name="wb-test-hosts-full")
    with pytest.raises(wb.ClusterStartError, match=r"no host can take 1 more engine\(s\).*unreachable"):
        cluster.start()
    assert cluster.state == "failed"


def test_workers_on_several_hosts_get_disjoint_gpus_of_their_own_host(four_gpus_each):
    """GPUs are per host: two workers on one host never share one; workers on different hosts may have the same ids."""
    layout = {h.ssh_host: 1 for h in four_gpus_each.hosts[:2]} | {four_gpus_each.hosts[2].ssh_host: 2}
    with _cluster(four_gpus_each, slots=0, name="wb-test-hosts-gpus", workers=3, gpus_per_worker=2, hosts=layout) as cluster:
        records = cluster.tasks
        assert {r.host for r in records} == {"host1", "host2", "host3"}
        seen = dict(zip(cluster.client.ids, cluster.client[:].apply_sync(os.getenv, "CUDA_VISIBLE_DEVICES")))
        for record in records:
            visible = seen[record.engine_id]
            if record.job == "ps":
                assert record.gpus == [] and visible == ""
            else:
                assert len(record.gpus) == 2 and set(record.gpus) <= {"0", "1", "2", "3"} and visible == ",".join(record.gpus)
        for host in {r.host for r in records}:
            taken = [g for r in records if r.host == host for g in r.gpus]
            assert len(taken) == len(set(taken)), f"two workers of {host} share a GPU: {taken}"
        workers = [r for r in records if r.job == "worker"]
        assert len({r.host for r in workers}) >= 2 and len({g for r in workers for g in r.gpus}) < 2 * len(workers)
