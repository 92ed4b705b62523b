"""A client's autograph files live in a directory of its own: gone at exit, and swept after a kill."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from conftest import read_line

from workbench.cluster.process import client_files

pytestmark = pytest.mark.cluster

CLIENT = """
    import sys, tensorflow as tf, workbench as wb
    from workbench.cluster.process import client_files
    cluster = wb.attach({name!r})
    cluster.connect()

    @tf.function
    def add(x):
        return x + 1 if x.shape.rank == 0 else x

    with cluster.device("worker:0"):
        add(tf.constant(1.0))
    print(client_files.directory(), flush=True)
    if "--wait" in sys.argv:
        sys.stdin.read()
"""


def _client(cluster, tmp_path, *args):
    script = tmp_path / "client.py"  # a file: autograph converts only functions whose source it can read
    script.write_text(textwrap.dedent(CLIENT.format(name=cluster.name)))
    return subprocess.Popen([sys.executable, str(script), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def _generated(directory: str) -> list[str]:
    return sorted(p.name for p in Path(directory).glob("__autograph_generated_file*.py"))


def test_a_client_that_exits_leaves_no_autograph_file(cluster, tmp_path):
    process = _client(cluster, tmp_path)
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 0
    directory = out.strip().splitlines()[-1]
    assert directory.startswith(os.path.join(tempfile.gettempdir(), client_files.PREFIX)), directory
    assert not os.path.exists(directory), "the exit handler did not remove the client's directory"


def test_a_killed_clients_autograph_files_are_swept_by_the_next_client(cluster, tmp_path):
    process = _client(cluster, tmp_path, "--wait")
    try:
        directory = read_line(process, 180, "its autograph directory").strip()
        assert _generated(directory), f"autograph wrote nothing under {directory}"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    assert os.path.isdir(directory)  # no exit handler ran
    assert directory in client_files.sweep()
    assert not os.path.exists(directory)
    live = tempfile.mkdtemp(prefix=f"{client_files.PREFIX}{os.getpid()}@{socket.gethostname()}-")  # a running client's
    try:
        assert live not in client_files.sweep() and os.path.isdir(live)  # a live process's directory is never swept
    finally:
        os.rmdir(live)


def test_a_directory_another_hosts_process_made_is_never_swept(tmp_path):
    # a temporary directory shared with another host, or with an sshd in a PID namespace of its own (test_ssh.py):
    # its pids name other processes, or none, here
    gone = 999_999_999  # above any pid_max: no such process here
    other_host = tmp_path / f"{client_files.PREFIX}{gone}@another-host-x1y2z3"
    this_host = tmp_path / f"{client_files.PREFIX}{gone}@{socket.gethostname()}-x1y2z3"
    from_before = tmp_path / f"{client_files.PREFIX}{gone}-x1y2z3"  # named before hosts were in the name
    for path in (other_host, this_host, from_before):
        path.mkdir()
    assert sorted(client_files.sweep(str(tmp_path))) == sorted([str(this_host), str(from_before)])
    assert other_host.is_dir()


def test_an_engine_started_by_another_launcher_writes_under_a_directory_of_its_own(tmp_path):
    """As Slurm, MPI or SSH start it: the engine bootstrap gives the engine a temporary directory of its own."""
    probe = ("import os, tempfile\nfrom workbench.cluster.process import client_files\n"
             "print(client_files.adopt_temporary_directory()); print(tempfile.gettempdir()); print(os.environ['TMPDIR'])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if k != "TMPDIR"})
    assert out.returncode == 0, out.stderr
    mine, gettempdir, env = out.stdout.split()
    assert mine == gettempdir == env and Path(mine).name.startswith(client_files.PREFIX)
    assert not os.path.exists(mine)  # removed at exit
    scratch = tmp_path / "workbench-wb-x-abc"  # a local engine's: its cluster's scratch directory stays in use
    scratch.mkdir()
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "TMPDIR": str(scratch)})
    assert out.stdout.split()[0] == str(scratch), out.stdout + out.stderr
