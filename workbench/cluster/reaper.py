"""A small process that outlives a killed client and cleans up after it.

The client starts one reaper per cluster, in its own session, and keeps a pipe to its stdin.
The reaper

* hosts the **lifeline**: every engine holds a TCP connection to it and exits when it closes;
* tracks the local processes the client started (controller, engines) and the registry file;
* when the pipe closes without a ``release`` message (the client died), kills those processes
  and removes the registry file, then exits, which closes every lifeline.

Client → reaper messages are JSON lines: ``{"watch": pid}``, ``{"registry": path}``,
``{"release": true}``. The reaper's first stdout line is ``"<host> <port>"`` of the lifeline.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import selectors
import socket
import subprocess
import sys
from pathlib import Path

import psutil

KILL_GRACE_SECONDS = 5.0


def kill_process_trees(pids: list[tuple[int, float]], grace: float = KILL_GRACE_SECONDS) -> None:
    """Terminate each ``(pid, create_time)`` and its descendants; SIGKILL what remains after ``grace``."""
    procs: dict[int, psutil.Process] = {}
    for pid, created in pids:
        try:
            proc = psutil.Process(pid)
            if created and abs(proc.create_time() - created) > 1.0:
                continue  # the pid was reused by an unrelated process
            for member in [proc, *proc.children(recursive=True)]:
                procs[member.pid] = member
        except psutil.Error:
            continue
    for proc in procs.values():
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _gone, alive = psutil.wait_procs(list(procs.values()), timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace)


def _listen(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server = socket.socket(family, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, 0))
    server.listen(128)
    server.setblocking(False)
    return server


def serve(host: str) -> None:
    server = _listen(host)
    print(f"{host} {server.getsockname()[1]}", flush=True)
    watched: list[tuple[int, float]] = []
    registry: list[str] = []
    released = False
    selector = selectors.DefaultSelector()
    stdin_fd = sys.stdin.fileno()
    selector.register(stdin_fd, selectors.EVENT_READ, "client")
    selector.register(server, selectors.EVENT_READ, "listen")
    pending = b""
    client_open = True
    while client_open:
        for key, _ in selector.select():
            if key.data == "client":
                chunk = os.read(stdin_fd, 65536)
                if not chunk:
                    client_open = False
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    message = json.loads(line)
                    if "watch" in message:
                        watched.append((int(message["watch"]), float(message.get("created", 0.0))))
                    if "registry" in message:
                        registry.append(message["registry"])
                    if message.get("release"):
                        released = True
            elif key.data == "listen":
                try:
                    conn, _addr = server.accept()
                except OSError:
                    continue
                conn.setblocking(False)
                selector.register(conn, selectors.EVENT_READ, "engine")
            else:
                try:
                    data = key.fileobj.recv(256)
                except OSError:
                    data = b""
                if not data:  # that engine is gone
                    selector.unregister(key.fileobj)
                    key.fileobj.close()
    if not released:
        kill_process_trees(watched)
        for path in registry:
            Path(path).unlink(missing_ok=True)
    # Exiting closes every lifeline: remote engines stop themselves.


class Reaper:
    """Client-side handle of a reaper process."""

    def __init__(self, host: str, start_timeout: float = 30.0):
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "workbench.cluster.reaper", "--host", host],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a signal to the client's process group must not reach it
            text=True,
        )
        ready, _, _ = select.select([self._proc.stdout], [], [], start_timeout)
        line = self._proc.stdout.readline().strip() if ready else ""
        if not line:
            self._proc.kill()
            self._proc.wait(timeout=10)
            raise RuntimeError(f"the workbench reaper did not start within {start_timeout:.0f} s")
        lifeline_host, port = line.split()
        self.address = (lifeline_host, int(port))

    @property
    def pid(self) -> int:
        return self._proc.pid

    def lifeline(self, token: str) -> str:
        """The value of the engines' lifeline variable."""
        return f"{self.address[0]} {self.address[1]} {token}"

    def _send(self, message: dict) -> None:
        if self._proc.poll() is None and self._proc.stdin and not self._proc.stdin.closed:
            self._proc.stdin.write(json.dumps(message) + "\n")
            self._proc.stdin.flush()

    def watch(self, pid: int) -> None:
        """Kill ``pid`` (and its descendants) if this client dies."""
        try:
            created = psutil.Process(pid).create_time()
        except psutil.Error:
            return
        self._send({"watch": pid, "created": created})

    def remove_on_death(self, path: str | os.PathLike) -> None:
        self._send({"registry": os.fspath(path)})

    def close(self, release: bool = True, timeout: float = 30.0) -> None:
        """End the reaper. ``release=True``: the client cleaned up itself, kill nothing."""
        if self._proc.poll() is None:
            try:
                if release:
                    self._send({"release": True})
                self._proc.stdin.close()
            except OSError:
                pass
            try:
                self._proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        if self._proc.stdout:
            self._proc.stdout.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address the lifeline listens on")
    args = parser.parse_args(argv)
    serve(args.host)

if __name__ == "__main__":
    main()
