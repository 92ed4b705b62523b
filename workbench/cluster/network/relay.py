"""The user-space link emulator: one process that carries every connection between a cluster's tasks.

Run as ``python -m workbench.cluster.network.relay`` by ``shaping.UserSpaceLinks`` (never by hand). Each task's
address in the ClusterSpec is a port of this process; its TensorFlow server listens on another port
(``ServerDef.port``), and this process forwards each connection to it. Knowing both ends of every
connection (the connecting process is looked up in ``/proc``), it meters each task like a host with
one network card: a task's sending and its receiving each draw from a token bucket of the link's
rate, and each chunk is held for the link's one-way delay before it goes on. Rates and delays change
while connections run. No root is needed, so this is the backend on Binder.

Commands arrive as JSON lines on stdin, answers leave as JSON lines on stdout; stdin closing (the
kernel exited) ends the process, so it cannot be orphaned. Single-threaded: one ``selectors`` loop.
"""

from __future__ import annotations

import collections
import json
import os
import selectors
import socket
import sys
import time
from typing import Any

CHUNK = 256 * 1024  # bytes read at once
MAX_SEND = 64 * 1024  # bytes sent at once on a shaped path (smooths low rates)
BUFFER = 4 * 1024 * 1024  # bytes held per direction before reading stops (TCP flow control does the rest)
IDLE_WAKE = 0.05  # seconds: the loop wakes at least this often
CLIENT = "client"  # a connection from a process that is not a task (the kernel)


class Bucket:
    """A token bucket of ``rate`` bytes/s; its depth is 4 ms of the rate (at least 64 KiB), as tc's tbf wants."""

    def __init__(self, rate: float):
        self.rate = rate
        self.depth = max(64 * 1024, rate / 250)
        self.tokens = self.depth
        self.stamp = time.monotonic()

    def refill(self, now: float) -> float:
        self.tokens = min(self.depth, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        return self.tokens

    def wait(self) -> float:
        """Seconds until the bucket holds a token again (0 when it holds some now)."""
        return 0.0 if self.tokens > 0 else -self.tokens / self.rate


class Links:
    """The shaping now in force: per task a rate (bytes/s, or None) and a one-way delay, and the shaped pairs."""

    def __init__(self):
        self.rates: dict[str, float | None] = {}
        self.delays: dict[str, float] = {}
        self.pairs: set[frozenset[str]] = set()
        self.egress: dict[str, Bucket] = {}
        self.ingress: dict[str, Bucket] = {}
        self.sent: collections.Counter = collections.Counter()  # (task, "out"|"in") -> bytes
        self.generation = 0

    def set(self, tasks: dict[str, dict], pairs: list[list[str]]) -> None:
        self.rates = {t: (float(s["rate"]) if s.get("rate") else None) for t, s in tasks.items()}
        self.delays = {t: float(s.get("delay") or 0.0) for t, s in tasks.items()}
        self.pairs = {frozenset(p) for p in pairs}
        self.egress = {t: Bucket(r) for t, r in self.rates.items() if r}
        self.ingress = {t: Bucket(r) for t, r in self.rates.items() if r}
        self.generation += 1

    def path(self, sender: str, receiver: str) -> tuple[list[Bucket], float]:
        """The buckets a chunk from ``sender`` to ``receiver`` draws from, and its one-way delay."""
        if frozenset((sender, receiver)) not in self.pairs:
            return [], 0.0
        buckets = [b for b in (self.egress.get(sender), self.ingress.get(receiver)) if b is not None]
        return buckets, max(self.delays.get(sender, 0.0), self.delays.get(receiver, 0.0))


class Direction:
    """One direction of a forwarded connection: bytes read from ``source`` wait here until due and paid for."""

    def __init__(self, source: socket.socket, sink: socket.socket, sender: str, receiver: str):
        self.source, self.sink = source, sink
        self.sender, self.receiver = sender, receiver
        self.queue: collections.deque[list] = collections.deque()  # [due, memoryview]
        self.held = 0
        self.eof = False  # the source closed: shut the sink's writing once the queue is empty
        self.done = False
        self.blocked = False  # the sink's buffer was full at the last send
        self.generation = -1
        self.buckets: list[Bucket] = []
        self.delay = 0.0

    def refresh(self, links: Links) -> None:
        if self.generation != links.generation:
            self.buckets, self.delay = links.path(self.sender, self.receiver)
            self.generation = links.generation

    def wants_read(self) -> bool:
        return not self.eof and self.held < BUFFER

    def pump(self, now: float, links: Links) -> float | None:
        """Send what is due and paid for; return seconds until more could go (None: nothing waits, or blocked)."""
        self.refresh(links)
        while self.queue:
            due, view = self.queue[0]
            if due > now:
                return due - now
            allowed = len(view)
            if self.buckets:
                for bucket in self.buckets:
                    bucket.refill(now)
                wait = max(b.wait() for b in self.buckets)
                if wait > 0:
                    return wait
                allowed = min(allowed, MAX_SEND)
            try:
                sent = self.sink.send(view[:allowed])
            except BlockingIOError:
                self.blocked = True  # woken by the sink's EVENT_WRITE
                return None
            except OSError:  # the other end reset the connection: drop what waits
                self.queue.clear()
                self.held, self.eof = 0, True
                break
            self.blocked = False
            for bucket in self.buckets:
                bucket.tokens -= sent
            links.sent[(self.sender, "out")] += sent
            links.sent[(self.receiver, "in")] += sent
            self.held -= sent
            if sent == len(view):
                self.queue.popleft()
            else:
                self.queue[0][1] = view[sent:]
                if sent < allowed:
                    self.blocked = True
                    return None
        if self.eof and not self.done:
            self.done = True
            try:
                self.sink.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        return None


def socket_owner(peer_port: int, local_port: int, pids: dict[int, str]) -> str:
    """The task whose process holds the socket connected from ``peer_port`` to our ``local_port``."""
    inodes = set()
    for table in ("/proc/net/tcp6", "/proc/net/tcp"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == peer_port and int(fields[2].rsplit(":", 1)[1], 16) == local_port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return CLIENT
    for pid, task in pids.items():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return task
            except OSError:
                continue
    return CLIENT


class Relay:
    """The process's state: listeners (one per task), forwarded connections, and the links in force."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.selector = selectors.DefaultSelector()
        self.links = Links()
        self.listeners: dict[str, socket.socket] = {}  # task -> listening socket
        self.targets: dict[str, tuple[str, int]] = {}  # task -> (host, port) of its TF server
        self.pids: dict[int, str] = {}
        self.directions: list[Direction] = []  # both directions of each connection, side by side
        self.sockets: dict[socket.socket, tuple[Direction, Direction]] = {}  # sock -> (reads it, writes it)
        self.started = time.monotonic()
        self.running = True
        self._partial = b""  # the start of a command line not yet complete

    # -- commands ---------------------------------------------------------------------------

    def command(self, message: dict[str, Any]) -> dict[str, Any]:
        kind = message.get("do")
        if kind == "listen":  # {"task", "target": "host:port"} -> the port to name in the ClusterSpec
            task = message["task"]
            host, _, port = message["target"].rpartition(":")
            self.targets[task] = (host.strip("[]"), int(port))
            if task not in self.listeners:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((self.host, int(message.get("port") or 0)))
                sock.listen(128)
                sock.setblocking(False)
                self.listeners[task] = sock
                self.selector.register(sock, selectors.EVENT_READ, ("listen", task))
            return {"port": self.listeners[task].getsockname()[1]}
        if kind == "pids":  # {"pids": {pid: task}}
            self.pids = {int(p): t for p, t in message["pids"].items()}
            return {}
        if kind == "shape":  # {"tasks": {task: {"rate": bytes/s|None, "delay": s}}, "pairs": [[a, b], ...]}
            self.links.set(message.get("tasks", {}), message.get("pairs", []))
            return {}
        if kind == "stats":
            sent = {f"{t} {d}": n for (t, d), n in self.links.sent.items()}
            cpu = os.times()
            return {"sent": sent, "cpu_seconds": cpu.user + cpu.system, "seconds": time.monotonic() - self.started,
                    "connections": len(self.directions) // 2}
        if kind == "stop":
            self.running = False
            return {}
        raise ValueError(f"unknown command {kind!r}")

    def read_commands(self, stdin) -> None:
        data = os.read(stdin.fileno(), 65536)
        if not data:  # the kernel is gone
            self.running = False
            return
        self._partial += data
        *lines, self._partial = self._partial.split(b"\n")
        for line in lines:
            if not line.strip():
                continue
            message = json.loads(line)
            try:
                answer = {"id": message.get("id"), "ok": True, **self.command(message)}
            except Exception as exc:  # noqa: BLE001 - answered to the kernel, which raises it there
                answer = {"id": message.get("id"), "ok": False, "error": f"{type(exc).__name__}: {exc}"}
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()

    # -- connections ------------------------------------------------------------------------

    def accept(self, task: str) -> None:
        listener = self.listeners[task]
        for _ in range(64):
            try:
                inbound, peer = listener.accept()
            except BlockingIOError:
                return
            source = socket_owner(peer[1], listener.getsockname()[1], self.pids)
            try:
                outbound = socket.create_connection(self.targets[task], timeout=5)
            except OSError:
                inbound.close()  # the task's server is not there (being re-hosted): the caller retries
                continue
            for sock in (inbound, outbound):
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            forward = Direction(inbound, outbound, source, task)
            backward = Direction(outbound, inbound, task, source)
            self.directions += [forward, backward]
            self.sockets[inbound] = (forward, backward)
            self.sockets[outbound] = (backward, forward)

    def receive(self, reading: Direction, now: float) -> None:
        try:
            data = reading.source.recv(CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            reading.eof = True
            return
        reading.refresh(self.links)
        reading.queue.append([now + reading.delay, memoryview(data)])
        reading.held += len(data)

    def close_finished(self) -> None:
        keep = []
        closing = set()
        for index in range(0, len(self.directions), 2):
            a, b = self.directions[index], self.directions[index + 1]
            if a.done and b.done:
                closing.update((a.source, a.sink))
            else:
                keep += [a, b]
        for sock in closing:
            if sock in self.selector.get_map():
                self.selector.unregister(sock)
            del self.sockets[sock]
            sock.close()
        self.directions = keep

    def interest(self) -> None:
        """Read from a socket while its direction has room; wait for writability where its sink is full."""
        for sock, (reading, writing) in list(self.sockets.items()):
            events = (selectors.EVENT_READ if reading.wants_read() else 0) | (
                selectors.EVENT_WRITE if writing.blocked else 0)
            registered = self.selector.get_map().get(sock)
            if registered is None and events:
                self.selector.register(sock, events, ("conn", reading))
            elif registered is not None and not events:
                self.selector.unregister(sock)
            elif registered is not None and registered.events != events:
                self.selector.modify(sock, events, ("conn", reading))

    def run(self) -> None:
        self.selector.register(sys.stdin, selectors.EVENT_READ, ("stdin",))
        sys.stdout.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
        sys.stdout.flush()
        while self.running:
            now = time.monotonic()
            wait = IDLE_WAKE
            for direction in self.directions:
                next_in = direction.pump(now, self.links)
                if next_in is not None:
                    wait = min(wait, next_in)
            self.close_finished()
            self.interest()
            for key, events in self.selector.select(max(wait, 0.0)):
                tag = key.data[0]
                if tag == "stdin":
                    self.read_commands(sys.stdin)
                elif tag == "listen":
                    self.accept(key.data[1])
                elif events & selectors.EVENT_READ:
                    self.receive(key.data[1], time.monotonic())


def main() -> None:
    host = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1"
    Relay(host).run()


if __name__ == "__main__":
    main()
