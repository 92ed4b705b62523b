"""Which launcher class a name gives: ipyparallel's, except SSH engines, which get the workbench's subclass."""

import signal

import pytest
from ipyparallel.cluster import launcher as ipp

import workbench as wb
from workbench.cluster.launch import ssh
from workbench.cluster.launch.launchers import engine_launcher_class


@pytest.mark.parametrize("name", ["ssh", "ipyparallel.cluster.launcher.SSHEngineSetLauncher"])
def test_ssh_engines_get_the_workbench_launcher_under_ipyparallels_name(name):
    cls = engine_launcher_class(name)
    assert cls is ssh.SSHEngineSetLauncher and issubclass(cls, ipp.SSHEngineSetLauncher)
    assert cls.__name__ == "SSHEngineSetLauncher"  # a user's c.SSHEngineSetLauncher... config still applies
    assert issubclass(cls.launcher_class, ipp.SSHEngineLauncher)


def test_other_launchers_are_ipyparallels_own():
    assert engine_launcher_class("mpi") is ipp.MPIEngineSetLauncher
    assert engine_launcher_class("slurm") is ipp.SlurmEngineSetLauncher
    with pytest.raises(wb.ConfigurationError, match="not a known ipyparallel engine launcher"):
        engine_launcher_class("no-such-launcher")


@pytest.mark.parametrize("given", [signal.SIGTERM, 15, "TERM", "SIGTERM"])
def test_a_signal_is_taken_by_number_or_name_as_ipyparallel_passes_it(given):
    assert ssh._signal_number(given) == signal.SIGTERM
