"""engines="ssh" against a real sshd (tests/sshd.py: loopback port, throwaway keys): start, train, scale, stop.

OpenSSH is installed when missing and the suite runs as root (CI does); otherwise the module is
skipped with the reason.
"""

from __future__ import annotations

import sys
import warnings

import psutil
import pytest
import sshd
from training_helpers import train

import workbench as wb

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


@pytest.fixture(scope="module")
def server():
    reason = sshd.available()
    if reason:
        pytest.skip(reason)
    daemon = sshd.LocalSSHD()
    try:
        yield daemon
    finally:
        daemon.close()


def _options(server) -> dict:
    return dict(ssh_args=server.ssh_args, scp_args=server.ssh_args, remote_python=sys.executable,
                remote_profile_dir=str(server.dir / "profile"))


def test_an_ssh_cluster_trains_and_stops(server):
    with warnings.catch_warnings():
        warnings.simplefilter("error", wb.ExposedPortsWarning)  # engines run the workbench's bootstrap over SSH too
        cluster = wb.Cluster(ps=1, workers=2, engines="ssh", hosts={f"127.0.0.1:{server.port}": 4}, controller_ip="127.0.0.1",
                             progress=False, start_timeout=120, name="wb-test-ssh", **_options(server))
        cluster.start()
    try:
        status = cluster.status()
        assert "engines: ssh" in str(status) and {t.name for t in status.tasks} == {"ps:0", "worker:0", "worker:1"}
        assert all(address.startswith("127.0.0.1:") for job in cluster.spec_dict.values() for address in job)
        sessions = server.run("true")  # the server still answers while it runs the engines
        assert sessions.returncode == 0
        # one command per host: the first engine imported TensorFlow, then forked the host's two others
        pids = {t.pid for t in status.tasks}
        assert sorted(psutil.Process(p).ppid() in pids for p in pids) == [False, True, True]
        job = train(cluster).wait(300)
        assert job.evaluate(wb.datasets.digits_test)["accuracy"] >= 0.9
        cluster.scale(workers=3)
        job = train(cluster, steps=99, batch_size=63).wait(300)
        assert job.state == "finished"
    finally:
        cluster.stop()


def test_hosts_that_are_not_a_map_of_engine_counts_are_refused():
    with pytest.raises(wb.ConfigurationError, match="must map each host to its number of engines"):
        wb.Cluster(engines="ssh", hosts=["node1", "node2"])
    with pytest.raises(wb.ConfigurationError, match=r"'node1': 0 is not a number of engines"):
        wb.Cluster(engines="ssh", hosts={"node1": 0})
    with pytest.raises(wb.ConfigurationError, match="use it with engines='ssh'"):
        wb.Cluster(engines="mpi", hosts={"node1": 2})
