"""The reaper kills what a dead client started, closes lifelines, and kills nothing on release."""

import os
import socket
import subprocess
import sys
import time

from conftest import wait_gone

from workbench.cluster.reaper import Reaper


def _sleeper():
    # a process with a child, like an engine and its nanny
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    time.sleep(1.0)
    return proc


def _lifeline(reaper):
    sock = socket.create_connection(reaper.address, timeout=5)
    sock.sendall(b"token\n")
    return sock


def test_client_death_kills_watched_trees_removes_registry_and_closes_lifelines(tmp_path):
    reaper = Reaper("127.0.0.1")
    proc = _sleeper()
    import psutil

    tree = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    assert len(tree) == 2
    registry_file = tmp_path / "c.json"
    registry_file.write_text("{}")
    reaper.watch(proc.pid)
    reaper.remove_on_death(registry_file)
    line = _lifeline(reaper)
    reaper.close(release=False)  # what a dying client does: its end of the pipe closes
    assert not wait_gone(tree, timeout=20)
    proc.wait(timeout=5)
    assert not registry_file.exists()
    line.settimeout(10)
    try:  # closed with EOF, or reset since the token was unread: the engine treats both the same
        assert line.recv(10) == b""
    except ConnectionResetError:
        pass
    line.close()


def test_release_kills_nothing(tmp_path):
    reaper = Reaper("127.0.0.1")
    proc = _sleeper()
    reaper.watch(proc.pid)
    registry_file = tmp_path / "c.json"
    registry_file.write_text("{}")
    reaper.remove_on_death(registry_file)
    reaper.close(release=True)
    try:
        assert proc.poll() is None
        assert registry_file.exists()
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(timeout=10)


def test_lifeline_value_names_the_reaper():
    reaper = Reaper("127.0.0.1")
    try:
        host, port, token = reaper.lifeline("wb-x").split()
        assert (host, int(port), token) == ("127.0.0.1", reaper.address[1], "wb-x")
    finally:
        reaper.close()
