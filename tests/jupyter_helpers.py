"""Jupyter processes the tests start: a server (its runtime file, then its port) and a kernel, ready."""

import json
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from jupyter_client import BlockingKernelClient, KernelManager

# what a kernel prints when another process took one of its ports between jupyter_client choosing it and the kernel
# binding it (a race every Jupyter front end has: Jupyter Server's restarter answers it with new ports)
_PORT_TAKEN = "Address already in use"


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


def start_kernel(new_manager: Callable[[], KernelManager], tries: int = 3, timeout: float = 120.0,
                 **start) -> tuple[KernelManager, BlockingKernelClient]:
    """A kernel from ``new_manager()`` started with ``start`` (``env``, ``cwd``) and a client it has answered.

    As Jupyter Server does, a kernel that died before answering because one of its ports was taken starts again on
    new ports (at most ``tries`` times); any other death fails with what the kernel wrote to its stderr.
    """
    attempt = 0
    while attempt < tries:
        attempt += 1
        manager = new_manager()
        client, said = _answered(manager, timeout, start)
        if client is not None:
            return manager, client
        if _PORT_TAKEN not in said:
            break
    last = said.splitlines()[-1] if said else "(nothing on its stderr)"
    raise AssertionError(f"the {manager.kernel_name} kernel died or did not answer within {timeout:.0f} s "
                         f"(try {attempt} of {tries}): {last}\n{said[-4000:]}")


def _answered(manager: KernelManager, timeout: float, start: dict) -> tuple[BlockingKernelClient | None, str]:
    """Start the kernel: a client it answered, else None and what the kernel wrote to stderr (it is shut down)."""
    with tempfile.TemporaryFile() as stderr:
        manager.start_kernel(stderr=stderr, **start)
        client = manager.client()
        client.start_channels()
        try:
            client.wait_for_ready(timeout=timeout)
            return client, ""
        except BaseException as exc:  # dead, silent, or an interrupt: the kernel goes either way
            client.stop_channels()
            manager.shutdown_kernel(now=True)
            if not isinstance(exc, RuntimeError):
                raise
            stderr.seek(0)
            return None, stderr.read().decode(errors="replace").strip()
