"""Which launcher class a name gives: ipyparallel's, except SSH engines, which get the workbench's subclass."""

import signal
import subprocess
import sys
import time

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


# A process with a thread whose id it prints
_WITH_A_THREAD = ("import threading, time\nthreading.Thread(target=lambda: (print(threading.get_native_id(), flush=True), "
                  "time.sleep(60)), daemon=True).start()\ntime.sleep(60)")


def test_the_hosts_kill_signals_the_engine_but_never_a_process_through_one_of_its_threads():
    """What an SSH engine's stop runs on its host, run here: a dead engine's pid may name a thread since."""
    targets = [subprocess.Popen([sys.executable, "-c", _WITH_A_THREAD], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        thread_id = int(targets[0].stdout.readline())
        subprocess.run([sys.executable, "-c", ssh._KILL_UNLESS_GONE.format(pid=thread_id, sig=int(signal.SIGTERM))], check=True,
                       timeout=30)
        subprocess.run([sys.executable, "-c", ssh._KILL_UNLESS_GONE.format(pid=targets[1].pid, sig=int(signal.SIGTERM))],
                       check=True, timeout=30)
        assert targets[1].wait(timeout=30) == -signal.SIGTERM  # the engine itself is signalled
        time.sleep(0.5)
        assert targets[0].poll() is None, "a signal to a thread's id reached its process"
    finally:
        for target in targets:
            target.kill()
            target.wait(timeout=30)
            target.stdout.close()
