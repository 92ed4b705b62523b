"""The Jupyter server's log stays clean while the panel's routes start, show, scale and stop a cluster,
and while one of its tasks is killed."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import ARTIFACTS

pytestmark = pytest.mark.cluster


def _task(listing: dict, name: str) -> dict:
    return next(t for t in listing["tasks"] if t["name"] == name)


def test_start_plots_scale_kill_and_stop_through_the_panels_routes_log_no_traceback(tmp_path, no_leftover_processes):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    holder.close()
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "server", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
             "--ServerApp.port_retries=0", "--IdentityProvider.token=quiet", f"--ServerApp.root_dir={tmp_path}", "--allow-root"],
            stdout=log, stderr=subprocess.STDOUT, env={**__import__("os").environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt")},
            start_new_session=True)

    def call(method: str, path: str, body=None):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/{path}", method=method, headers={"Authorization": "token quiet"},
                                         data=json.dumps(body).encode() if body is not None else None)
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.loads(response.read() or b"null")

    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                call("GET", "api/status")
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.2)
        call("POST", "workbench/api/clusters", {"name": "wb-test-server-log", "ps": 1, "workers": 1})
        assert {p["name"] for p in call("GET", "workbench/api/clusters/wb-test-server-log/plots")["plots"]} >= {"timeline"}
        call("GET", "workbench/api/clusters/wb-test-server-log/summary")
        call("PATCH", "workbench/api/clusters/wb-test-server-log", {"workers": 2})
        # a task killed as a crash would: the owner (this server) sees it go, and says so without a traceback
        killed = _task(call("GET", "workbench/api/clusters/wb-test-server-log"), "worker:1")
        os.kill(killed["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (now := _task(call("GET", "workbench/api/clusters/wb-test-server-log"), "worker:1"))["state"] == "running" \
                and now["pid"] == killed["pid"]:
            assert time.monotonic() < deadline, f"worker:1 still shows as running 60 s after its kill: {now}"
            time.sleep(0.5)
        call("DELETE", "workbench/api/clusters/wb-test-server-log")
        deadline = time.monotonic() + 60
        while "wb-test-server-log" in {c["name"] for c in call("GET", "workbench/api/clusters")["clusters"]}:
            assert time.monotonic() < deadline, "the cluster did not stop"
            time.sleep(0.5)
    finally:
        server.terminate()
        server.wait(30)
    text = log_path.read_text()
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "server-log.txt").write_text(text)
    assert "Traceback" not in text and "Event loop stopped before Future completed" not in text, text[-4000:]
    assert len(text.splitlines()) < 80, f"{len(text.splitlines())} log lines for one cluster's life"
