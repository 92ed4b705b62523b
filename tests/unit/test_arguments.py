"""Bad arguments raise a WorkbenchError subclass that says what to change, before anything starts."""

import pytest
from conftest import descendants

import workbench as wb


@pytest.mark.parametrize("kwargs, match", [
    (dict(ps=-1), "ps=-1 is not allowed"),
    (dict(workers=0), "at least one worker"),
    (dict(engines="kubernetes"), "not a known ipyparallel engine launcher: use one of .*local.*slurm"),
    (dict(engines=""), "not a launcher name"),
    (dict(gpus_per_worker=-1), "gpus_per_worker=-1"),
    (dict(gpus_per_worker=1.5), "gpus_per_worker=1.5"),
    (dict(name="no spaces allowed"), "not a valid cluster name"),
    (dict(start_timeout=0), "start_timeout=0"),
    (dict(queeu="gpu"), r"unknown launcher option\(s\) 'queeu'"),
    (dict(cluster_id="x"), "set by the workbench"),
])
def test_bad_arguments_fail_before_anything_starts(kwargs, match):
    before = descendants()
    with pytest.raises(wb.ConfigurationError, match=match):
        wb.Cluster(**kwargs)
    assert descendants() == before


def test_more_gpus_than_present(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(wb.ConfigurationError, match=r"need 4 GPU\(s\), but this machine has 1"):
        wb.Cluster(workers=2, gpus_per_worker=2)


def test_more_gpus_than_present_without_any_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(wb.ConfigurationError, match="this machine has none: .*gpus_per_worker=0 to train on CPUs"):
        wb.Cluster(workers=1, gpus_per_worker=1)


def test_launcher_options_of_the_chosen_launcher_are_accepted():
    # Slurm's own options pass through; nothing starts until start().
    cluster = wb.Cluster(engines="slurm", queue="debug", controller_ip="127.0.0.1")
    assert cluster.state == "new"


def test_using_a_cluster_that_never_started_says_what_to_do():
    cluster = wb.Cluster()
    with pytest.raises(wb.ClusterStateError, match="Call cluster.start"):
        cluster.scale(workers=3)
    with pytest.raises(wb.UnknownTaskError, match="has no task worker:0"):
        cluster.task("worker:0")
    cluster.stop()  # stopping what never started is harmless
    assert cluster.state == "new"


def test_a_checkout_imported_without_installing_says_to_install(monkeypatch):
    """From a folder on PYTHONPATH ipyparallel has no entry point for the workbench's launcher (seen on a GPU machine)."""
    import ipyparallel.cluster.launcher as ipp_launcher

    real = ipp_launcher.find_launcher_class

    def without_workbench_entry_points(name, kind):
        if name == "workbench-fork":
            raise KeyError(name)
        return real(name, kind)

    monkeypatch.setattr(ipp_launcher, "find_launcher_class", without_workbench_entry_points)
    before = descendants()
    with pytest.raises(wb.ConfigurationError, match=r"imported from a folder .* pip install -e \."):
        wb.Cluster(workers=1)
    assert descendants() == before
