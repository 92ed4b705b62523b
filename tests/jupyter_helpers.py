"""Waiting for a Jupyter server the tests started: its runtime file, then its port."""

import json
import socket
import subprocess
import time
from pathlib import Path


def wait_for_server(runtime: Path, process: subprocess.Popen, timeout: float = 120.0, what: str = "the Jupyter server") -> str:
    """The server's URL once it accepts connections (Jupyter Server writes its runtime file before it listens)."""
    deadline = time.monotonic() + timeout
    while not list(runtime.glob("jpserver-*.json")):
        assert process.poll() is None and time.monotonic() < deadline, f"{what} did not start"
        time.sleep(0.2)
    url = json.loads(next(runtime.glob("jpserver-*.json")).read_text())["url"].rstrip("/")
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1).close()
            return url
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, f"{what} wrote {url} but never listened there"
            time.sleep(0.1)


def stop_server(process: subprocess.Popen) -> None:
    """Terminate a server the test started; kill it if it has not exited within 30 s."""
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
