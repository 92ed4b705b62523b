"""A small process that outlives a killed client, cleans up after it, and reports the engines' health.

The client starts one reaper per cluster, in its own session, and keeps a pipe to its stdin.
The reaper

* hosts the **lifeline**: every engine holds a TCP connection to it and exits when it closes;
* tracks the local processes the client started (controller, engines) and the files to remove
  with them (the registry record, ipyparallel's connection and cluster files);
* when the pipe closes without a ``release`` message (the client died), kills those processes
  and removes those files, then exits, which closes every lifeline;
* reports on its stdout, one JSON line each, what it sees of the engines and of the processes
  the client asked it to keep an eye on: ``{"event": "lost", "pid", "host"}`` when an engine's
  lifeline closes (the engine is gone, wherever it ran), ``"silent"`` when an engine has not
  answered the reaper's pings for ``SILENT_SECONDS`` (stopped, frozen, or cut off), ``"alive"``
  when it answers again, and ``{"event": "exited", "pid"}`` when a process named in a
  ``health`` message (the controller) is gone.

Client → reaper messages are JSON lines: ``{"watch": pid}``, ``{"registry": path}`` (a file to remove),
``{"health": pid}``, ``{"release": true}``. The reaper's first stdout line is ``"<host> <port>"``
of the lifeline. An engine's first line on its lifeline is ``"<token> <pid> <host>"``; after it,
the engine echoes every byte the reaper sends (one ping every ``PING_SECONDS``). A connection whose first
line is anything else is not an engine's: it is closed, and nothing is reported of it.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import selectors
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from ..machine.processes import CREATED_SLACK, find_process, process_trees

KILL_GRACE_SECONDS = 5.0
PING_SECONDS = 0.5  # how often the reaper pings each engine over its lifeline
SILENT_SECONDS = 3.0  # an engine that has not answered for this long is reported silent
HELLO_LIMIT = 1024  # bytes an engine's first line may take; more, and the connection is not an engine's


def kill_process_trees(pids: list[tuple[int, float]], grace: float = KILL_GRACE_SECONDS) -> None:
    """Terminate (and continue, if stopped) each ``(pid, create_time)``, its descendants and the rest of the
    process group it led; SIGKILL what remains after ``grace``. A pid taken since by another process or by a
    thread is left alone (``find_process``); a create time of 0 skips only the first check."""
    procs = {proc.pid: proc for proc in process_trees(pids)}
    for member in _left_in_groups(dict(pids)):
        procs.setdefault(member.pid, member)
    for proc in procs.values():
        try:
            proc.terminate()
            proc.resume()  # a stopped process (SIGSTOP, a frozen host) only handles its SIGTERM once continued
        except psutil.Error:
            pass
    _gone, alive = psutil.wait_procs(list(procs.values()), timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=KILL_GRACE_SECONDS)  # a killed engine takes a moment to exit (its memory goes)


def _left_in_groups(leaders: dict[int, float]) -> list[psutil.Process]:
    """Live processes in the process group of one of ``leaders`` (pid -> create time, 0 if unknown).

    A killed leader's children are re-parented to init, out of reach of ``children()``, but keep its
    group: a controller killed with SIGKILL left a process it had forked running. A group's id is
    its leader's pid, and Linux gives no new process a pid still used as a group id, so the group
    of a dead leader is still that leader's. This process's own group is never included.
    """
    own = os.getpgid(0)
    left = []
    for proc in psutil.process_iter(["create_time"]):
        try:
            group = os.getpgid(proc.pid)
        except OSError:
            continue
        if group in leaders and group != own and proc.pid != group and proc.info["create_time"] >= leaders[group] - CREATED_SLACK:
            left.append(proc)
    return left


def _listen(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server = socket.socket(family, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, 0))
    server.listen(128)
    server.setblocking(False)
    return server


class _Engine:
    """The reaper's view of one engine's lifeline: who it is, and when it last answered a ping."""

    def __init__(self, conn: socket.socket, now: float):
        self.conn = conn
        self.pending = b""
        self.pid = 0
        self.host = ""
        self.answered = now
        self.silent = False
        self.stray = False  # not an engine: its first line was not "<token> <pid> <host>"

    def received(self, data: bytes, now: float) -> None:
        if not self.pid:  # the first line names the engine; what follows are answers to pings
            self.pending += data
            if b"\n" not in self.pending:
                self.stray = len(self.pending) > HELLO_LIMIT
                return
            line, _, data = self.pending.partition(b"\n")
            fields = line.decode(errors="replace").split()
            if len(fields) != 3 or not fields[1].isdigit() or int(fields[1]) == 0:
                # something else reached the port (a gRPC client retrying an address this port once had
                # sends "PRI * HTTP/2.0"): reported as an engine, its silence and its close were noise
                self.stray = True
                return
            self.pid, self.host = int(fields[1]), fields[2]
            self.pending = b""
        self.answered = now

    def ping(self) -> None:
        try:
            self.conn.send(b".")
        except OSError:  # a full buffer (an engine that reads nothing) or a closing socket: it shows as silence
            pass


class _Reporter:
    """Writes events to stdout without ever blocking: a client that stopped reading must not stop the reaper."""

    def __init__(self) -> None:
        self.fd = sys.stdout.fileno()
        os.set_blocking(self.fd, False)

    def __call__(self, **event) -> None:
        try:
            os.write(self.fd, (json.dumps(event) + "\n").encode())
        except OSError:  # the client is not reading (or gone): the event is dropped
            pass


def serve(host: str) -> None:
    server = _listen(host)
    print(f"{host} {server.getsockname()[1]}", flush=True)
    report = _Reporter()
    watched: list[tuple[int, float]] = []
    health: set[int] = set()
    registry: list[str] = []
    released = False
    engines: dict[int, _Engine] = {}
    selector = selectors.DefaultSelector()
    stdin_fd = sys.stdin.fileno()
    selector.register(stdin_fd, selectors.EVENT_READ, "client")
    selector.register(server, selectors.EVENT_READ, "listen")
    pending = b""
    client_open = True
    next_tick = time.monotonic()
    while client_open:
        for key, _ in selector.select(timeout=max(0.0, next_tick - time.monotonic())):
            now = time.monotonic()
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
                    if "health" in message:
                        health.add(int(message["health"]))
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
                engines[conn.fileno()] = _Engine(conn, now)
                selector.register(conn, selectors.EVENT_READ, "engine")
            else:
                engine = engines[key.fileobj.fileno()]
                try:
                    data = key.fileobj.recv(4096)
                except OSError:
                    data = b""
                if data:
                    engine.received(data, now)
                if not data or engine.stray:  # that engine is gone, or it was not an engine (its pid is unset)
                    selector.unregister(key.fileobj)
                    del engines[key.fileobj.fileno()]
                    key.fileobj.close()
                    if engine.pid:
                        report(event="lost", pid=engine.pid, host=engine.host)
                    continue
                if engine.silent:
                    engine.silent = False
                    report(event="alive", pid=engine.pid, host=engine.host)
        now = time.monotonic()
        if now >= next_tick:
            next_tick = now + PING_SECONDS
            _tick(engines, health, report, now)
    if not released:
        kill_process_trees(watched)
        for path in registry:
            if Path(path).is_dir():  # a cluster's scratch directory
                shutil.rmtree(path, ignore_errors=True)
            else:
                Path(path).unlink(missing_ok=True)
    # Exiting closes every lifeline: remote engines stop themselves.


def _tick(engines: dict[int, _Engine], health: set[int], report: _Reporter, now: float) -> None:
    """Ping every engine, report the ones that went silent, and the watched processes that exited."""
    for engine in engines.values():
        engine.ping()
        if engine.pid and not engine.silent and now - engine.answered > SILENT_SECONDS:
            engine.silent = True
            report(event="silent", pid=engine.pid, host=engine.host, seconds=round(now - engine.answered, 1))
    for pid in [p for p in health if not _running(p)]:
        health.discard(pid)
        report(event="exited", pid=pid)


def _running(pid: int) -> bool:
    proc = find_process(pid)
    try:
        return proc is not None and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Reaper:
    """Client-side handle of a reaper process."""

    def __init__(self, host: str, start_timeout: float = 30.0):
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "workbench.cluster.launch.reaper", "--host", host],
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
        self._send_lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def lifeline(self, token: str) -> str:
        """The value of the engines' lifeline variable."""
        return f"{self.address[0]} {self.address[1]} {token}"

    def _send(self, message: dict) -> None:
        with self._send_lock:
            if self._proc.poll() is None and self._proc.stdin and not self._proc.stdin.closed:
                self._proc.stdin.write(json.dumps(message) + "\n")
                self._proc.stdin.flush()

    def watch(self, pid: int) -> None:
        """Kill ``pid`` (and its descendants) if this client dies."""
        proc = find_process(pid)
        if proc is not None:  # psutil read its create time when it made proc
            self._send({"watch": pid, "created": proc.create_time()})

    def remove_on_death(self, path: str | os.PathLike) -> None:
        self._send({"registry": os.fspath(path)})

    def health(self, pid: int) -> None:
        """Report (an ``exited`` event) when the local process ``pid`` is gone."""
        self._send({"health": pid})

    def events(self) -> Iterator[dict]:
        """What the reaper reports, as it comes (blocks); ends when the reaper exits. One reader at a time."""
        for line in self._proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and "event" in event:
                yield event

    def close(self, release: bool = True, timeout: float = 30.0) -> None:
        """End the reaper. ``release=True``: the client cleaned up itself, kill nothing."""
        if self._proc.poll() is None:
            try:
                if release:
                    self._send({"release": True})
                with self._send_lock:
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
