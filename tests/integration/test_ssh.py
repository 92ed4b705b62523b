"""engines="ssh" against a real sshd (tests/sshd.py: loopback port, throwaway keys): start, train, scale, stop.

OpenSSH is installed when missing and the suite runs as root (CI does); otherwise the module is
skipped with the reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import psutil
import pytest
import sshd
from training_helpers import STEPS_OF_A_MECHANIC, assert_trained, train, wait_for

import workbench as wb
from workbench.cluster.process import client_files

pytestmark = pytest.mark.usefixtures("no_leftover_processes")
OTHER_HOST = "wb-other-host"
PIDS_TO_ENGINES = 1200  # pids the other host hands out before its engines' (they had pids 620-830 past its last)


def _sshd(**options):
    """A ``LocalSSHD`` for this module's tests, or a skip saying why none can run here."""
    reason = sshd.available()
    if not reason and options and os.geteuid() != 0:
        reason = "an sshd with a host name and process ids of its own needs root (namespaces)"
    if reason:
        pytest.skip(reason)
    daemon = sshd.LocalSSHD(**options)
    try:
        yield daemon
    finally:
        daemon.close()


@pytest.fixture(scope="module")
def server():
    yield from _sshd()


@pytest.fixture(scope="module")
def other_host():
    """An sshd that looks like another machine: its own host name and its own process ids."""
    yield from _sshd(hostname=OTHER_HOST, own_pids=True)
    # its engines' temporary directories, which a workbench process on that host would sweep (it shares /tmp here)
    for path in Path(tempfile.gettempdir()).glob(f"{client_files.PREFIX}*@{OTHER_HOST}-*"):
        shutil.rmtree(path, ignore_errors=True)


def _options(server, **ssh) -> dict:
    """The guide's options: the key and client options in ``ssh_args`` (scp takes those it shares with ssh)."""
    return {"ssh_args": server.ssh_args, "remote_python": sys.executable,
            "remote_profile_dir": str(server.dir / "profile"), **ssh}


def test_an_ssh_cluster_trains_and_stops(server, capfd):
    options = server.ssh_args  # one list for ssh and scp: ipyparallel appends each host's port to the lists it holds
    given = list(options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", wb.ExposedPortsWarning)  # engines run the workbench's bootstrap over SSH too
        cluster = wb.Cluster(ps=1, workers=2, engines="ssh", hosts={f"127.0.0.1:{server.port}": 4}, controller_ip="127.0.0.1",
                             progress=False, start_timeout=120, name="wb-test-ssh",
                             **_options(server, ssh_args=options, scp_args=options))
        cluster.start()
    assert options == given  # the user's list, as it was given
    try:
        status = cluster.status()
        assert "engines: ssh" in str(status) and {t.name for t in status.tasks} == {"ps:0", "worker:0", "worker:1"}
        assert all(address.startswith("127.0.0.1:") for job in cluster.spec_dict.values() for address in job)
        sessions = server.run("true")  # the server still answers while it runs the engines
        assert sessions.returncode == 0
        # one command per host: the first engine imported TensorFlow, then forked the host's two others
        pids = {t.pid for t in status.tasks}
        assert sorted(psutil.Process(p).ppid() in pids for p in pids) == [False, True, True]
        assert_trained(train(cluster, steps=STEPS_OF_A_MECHANIC).wait(300), STEPS_OF_A_MECHANIC, {"worker:0", "worker:1"})
        cluster.scale(workers=3)
        job = train(cluster, steps=99, batch_size=63).wait(300)
        assert job.state == "finished"
    finally:
        cluster.stop()
    # signalling an engine that had exited already (before ipyparallel's watcher saw it) printed the host's traceback
    assert "Traceback" not in capfd.readouterr().err


def _process_of(pid: int) -> psutil.Process | None:
    """The process ``pid`` names here, if any: itself, or the process ``pid`` is a thread of (``/proc/<tid>``
    answers for a thread too, though it is not listed; its ``Tgid`` is its process)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        return psutil.Process(next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Tgid:")))
    except (FileNotFoundError, ProcessLookupError, psutil.NoSuchProcess):
        return None


def _pids_free_here(count: int, tried: set[int]) -> int:
    """The first of ``count`` consecutive pids that no process or thread here has, none of them ``tried``, of such
    ranges the one this machine reaches last (it hands out the pids after its last one, then wraps); without one,
    the widest range."""
    top = int(Path("/proc/sys/kernel/pid_max").read_text())
    last = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
    used = sorted({int(task.name) for task in Path("/proc").glob("[0-9]*/task/[0-9]*")} | tried | {0, last, top})
    gaps = [(low + 1, high - low - 1) for low, high in zip(used, used[1:]) if high - low > 1]
    if wide := [start for start, size in gaps if size >= count]:
        return max(wide, key=lambda start: (start - last - 1) % top)
    return max(gaps, key=lambda gap: gap[1])[0]


def _start_with_engine_pids_free_here(other_host) -> tuple[wb.Cluster, list[int]]:
    """A cluster on the other host whose engines' pids no process here has (the other host hands out its pids
    from a range free here; at most three starts), and those pids, highest first."""
    tried: set[int] = set()
    for _ in range(3):
        first = _pids_free_here(PIDS_TO_ENGINES, tried)
        assert other_host.run(f"echo {first - 1} > /proc/sys/kernel/ns_last_pid").returncode == 0
        cluster = wb.Cluster(ps=1, workers=1, engines="ssh", hosts={f"127.0.0.1:{other_host.port}": 2},
                             controller_ip="127.0.0.1", progress=False, start_timeout=120, name="wb-test-ssh-other",
                             **_options(other_host))
        cluster.start()
        try:
            tasks = cluster.status().tasks
            assert {t.host for t in tasks} == {OTHER_HOST}
            pids = sorted({t.pid for t in tasks}, reverse=True)
        except BaseException:
            cluster.stop()
            raise
        if all(_process_of(pid) is None for pid in pids):
            return cluster, pids
        cluster.stop()
        tried |= set(range(first, pids[0] + 1))
    raise AssertionError(f"three clusters on the other host had an engine's pid that a process here has: {pids}")


def _sleeper_with_pid(pid: int) -> psutil.Process:
    """A ``sleep`` of this machine whose pid is ``pid`` (root sets the next pid): the process a signal meant for a
    remote engine of that pid would reach."""
    if (owner := _process_of(pid)) is not None:
        raise AssertionError(f"pid {pid}, an engine's on the other host, is taken here too: {owner}")
    for _ in range(5):
        with open("/proc/sys/kernel/ns_last_pid", "w") as last:
            last.write(str(pid - 1))
        sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
        if sleeper.pid == pid:
            return psutil.Process(pid)
        sleeper.kill()  # a thread started meanwhile took the id before the sleep: wait until it is free again
        sleeper.wait(10)
        wait_for(lambda: _process_of(pid) is None, 30, f"pid {pid} to be free again")
    raise AssertionError(f"could not make a process with pid {pid} here")


def test_stopping_a_cluster_on_another_host_kills_no_process_here_that_has_an_engines_pid(other_host):
    # An engine's process id on its host names some unrelated process on the client's machine: the client
    # watched it as its own and killed it (and its children) at stop, or when the client died. Each engine's pid
    # is given here to a sleep of this test's (the other host's pids come from a range no process here has: one
    # of the machine's, which may end by itself, would say nothing of the client).
    cluster, pids = _start_with_engine_pids_free_here(other_host)
    bystanders = []
    try:
        for pid in pids:  # downwards: the pids handed out after a sleep's are above it, never one still to make
            bystanders.append(_sleeper_with_pid(pid))
        assert train(cluster, steps=20).wait(120).state == "finished"
    finally:
        cluster.stop()
        try:
            assert all(b.is_running() and b.status() != psutil.STATUS_ZOMBIE for b in bystanders), bystanders
        finally:
            for b in bystanders:
                with contextlib.suppress(psutil.Error):
                    if b.name() == "sleep" and b.ppid() == os.getpid():
                        b.kill()
                        b.wait(10)

    def engines_left():
        left = []
        for child in psutil.Process(other_host.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):  # one that exits meanwhile is not left
                if "python" in child.name():
                    left.append(child)
        return left
    wait_for(lambda: not engines_left(), 30, "the engines on the other host to exit")


def test_an_ssh_command_that_fails_says_which_on_which_host_and_what_to_check(server, tmp_path):
    stranger = tmp_path / "not-the-key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True, timeout=30)
    options = ["-i", str(stranger), *server.ssh_args[2:]]  # the server does not know this key
    cluster = wb.Cluster(ps=1, workers=1, engines="ssh", hosts={f"127.0.0.1:{server.port}": 2}, controller_ip="127.0.0.1",
                         progress=False, start_timeout=60, name="wb-test-ssh-refused", **_options(server, ssh_args=options))
    with pytest.raises(wb.ClusterStartError) as raised:
        cluster.start()
    message = str(raised.value)
    assert "over SSH failed" in message and "127.0.0.1" in message and "without a prompt" in message, message
    assert str(stranger) in message and "ssh_args=" in message and "CalledProcessError" not in message, message
    assert cluster.state == "failed"


def test_scp_takes_the_options_it_shares_with_ssh():
    from workbench.cluster.launch.ssh import scp_options

    assert scp_options(["-i", "key", "-o", "BatchMode=yes", "-p", "2222", "-l", "me", "-T", "-C"]) == [
        "-i", "key", "-o", "BatchMode=yes", "-P", "2222", "-C"]


def test_hosts_that_are_not_a_map_of_engine_counts_are_refused():
    with pytest.raises(wb.ConfigurationError, match="must map each host to its number of engines"):
        wb.Cluster(engines="ssh", hosts=["node1", "node2"])
    with pytest.raises(wb.ConfigurationError, match=r"'node1': 0 is not a number of engines"):
        wb.Cluster(engines="ssh", hosts={"node1": 0})
    with pytest.raises(wb.ConfigurationError, match="use it with engines='ssh'"):
        wb.Cluster(engines="mpi", hosts={"node1": 2})
