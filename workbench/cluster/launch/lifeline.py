"""The engine's lifeline: a TCP connection to the client's reaper; the engine exits when it closes.

This is what makes engines exit after their client is killed (SIGKILL, a crashed kernel)
wherever they run, local or on other hosts. The same connection tells the client how its engines
are: the engine names itself (pid, host) when it connects and answers the reaper's pings, so the
reaper reports at once an engine whose connection closed, and one that stopped answering.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

LIFELINE_ENV = "WORKBENCH_LIFELINE"  # "host port token"
PREIMPORT_ENV = "WORKBENCH_PREIMPORT"
LIFELINE_CONNECT_TIMEOUT = 20.0
THREAD_NAME = "workbench-lifeline"


def _die(message: str, code: int) -> None:
    print(f"workbench engine {os.getpid()}: {message}", file=sys.stderr, flush=True)
    os._exit(code)


def hold_lifeline(value: str) -> None:
    """Connect to the reaper named in ``value`` and exit the process when it goes away."""
    host, port, token = value.split()
    deadline = time.monotonic() + LIFELINE_CONNECT_TIMEOUT
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=5)
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                _die(f"cannot reach the client's lifeline at {host}:{port} ({exc}); the client is gone", 3)
            time.sleep(0.5)
    sock.settimeout(None)
    sock.sendall(f"{token} {os.getpid()} {socket.gethostname()}\n".encode())

    def watch() -> None:
        try:
            while ping := sock.recv(64):
                sock.sendall(ping)  # a stopped or frozen engine does not answer: the reaper reports it silent
        except OSError:
            pass
        _die("the client that started this engine is gone; exiting", 0)

    threading.Thread(target=watch, name=THREAD_NAME, daemon=True).start()


def holding_lifeline() -> bool:
    return any(thread.name == THREAD_NAME for thread in threading.enumerate())
