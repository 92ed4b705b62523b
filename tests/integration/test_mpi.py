"""engines="mpi" with a real Open MPI (Debian's openmpi-bin, mpi4py from the test extra): start, train, scale, stop.

openmpi-bin is installed when missing and the suite runs as root (CI does); otherwise the module is
skipped with the reason.
"""

from __future__ import annotations

import os
import warnings

import debian
import psutil
import pytest
from training_helpers import STEPS_OF_A_MECHANIC, assert_trained, train

import workbench as wb
from workbench.cluster.launch import mpi

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


@pytest.fixture(scope="module", autouse=True)
def open_mpi():
    reason = debian.ensure(["mpiexec"], ["openmpi-bin"], "Open MPI")
    if reason:
        pytest.skip(reason)


def _expected_notices(engines: int) -> set[str]:
    expected = {"--bind-to none"}
    if os.geteuid() == 0:
        expected.add("--allow-run-as-root")
    if engines > (psutil.cpu_count(logical=False) or 1):
        expected.add("--oversubscribe")
    return expected


def test_an_mpi_cluster_trains_scales_and_stops(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cluster = wb.Cluster(ps=1, workers=2, engines="mpi", controller_ip="127.0.0.1", progress=False,
                             start_timeout=120, name="wb-test-mpi")
        cluster.start()
    try:
        notices = [str(w.message) for w in caught if issubclass(w.category, wb.LauncherOptionsWarning)]
        flags = ("--allow-run-as-root", "--oversubscribe", "--bind-to none")
        assert {flag for flag in flags if any(flag in n for n in notices)} == _expected_notices(3), notices
        assert not [w for w in caught if issubclass(w.category, wb.ExposedPortsWarning)]  # tasks bind 127.0.0.1 only
        status = cluster.status()
        assert "engines: mpi" in str(status) and {t.name for t in status.tasks} == {"ps:0", "worker:0", "worker:1"}
        assert all(address.startswith("127.0.0.1:") for job in cluster.spec_dict.values() for address in job)
        mpiexec = [p for p in psutil.Process().children(recursive=True) if p.name() in ("mpiexec", "orterun", "mpirun")]
        assert mpiexec, "the engines were not started through mpiexec"
        cores = set(range(psutil.cpu_count()))
        assert all(set(psutil.Process(t.pid).cpu_affinity()) == cores for t in status.tasks)  # no rank pinned to one core

        for strategy in ("async-ps", "allreduce"):
            job = train(cluster, strategy=strategy, steps=STEPS_OF_A_MECHANIC).wait(300)
            assert_trained(job, STEPS_OF_A_MECHANIC, {"worker:0", "worker:1"})

        cluster.scale(workers=3)  # a second mpiexec, with one rank (which Open MPI would pin to one core)
        assert len(cluster.spec_dict["worker"]) == 3
        assert all(set(psutil.Process(t.pid).cpu_affinity()) == cores for t in cluster.status().tasks)
        job = train(cluster, steps=100, batch_size=63).wait(300)
        assert job.state == "finished"
    finally:
        cluster.stop()


def test_a_missing_mpiexec_is_named_before_anything_starts(no_leftover_processes):
    cluster = wb.Cluster(ps=1, workers=1, engines="mpi", mpi_cmd=["no-such-mpiexec"], controller_ip="127.0.0.1",
                         progress=False, name="wb-test-mpi-missing")
    with pytest.raises(wb.ConfigurationError, match=r"'no-such-mpiexec', which is not on PATH.*apt-get install openmpi-bin"):
        cluster.start()
    assert cluster.state == "failed"


def test_options_the_user_chose_are_left_alone():
    """Open MPI flags the user passed (or an allocation's host list) are never added a second time."""
    assert mpi.flavour(["mpiexec"]) == "openmpi"
    added, _ = mpi.added_args(["mpiexec"], ["--allow-run-as-root", "--oversubscribe", "--bind-to", "core"], 64)
    assert added == []
    added, notices = mpi.added_args(["mpiexec"], ["--hostfile", "hosts"], 64)
    assert "--oversubscribe" not in added  # ranks go to the listed hosts' slots
    assert added[-2:] == ["--bind-to", "none"] and any("--bind-to none" in n for n in notices)
