"""The warm process: imports TensorFlow once, then forks engines (and their nannies) on request.

An engine that imports TensorFlow itself costs 300+ MiB of private memory and seconds of CPU. The
warm process imports TensorFlow, Keras (without the libraries it loads for a kernel's sake: ``lean_import``),
ipyparallel's engine and the workbench's engine side once, freezes the garbage collector, and forks:
each engine starts with all of that already in memory, shared copy-on-write, and only what it then
does on its own is private.

A fork is only safe from a process that has never run a TensorFlow op, started a server, created a
zmq context or loaded a GPU driver, and that has one thread. This program does none of those, and
checks them before every fork (``fork_problem``); when one fails it refuses, saying why, and the
launcher starts engines the ordinary way.

Run as ``python -m workbench.cluster.launch.warm --socket PATH [--preload MODULE ...]``. It binds ``PATH``
(a ``SOCK_SEQPACKET`` unix socket in a private directory) before importing anything heavy, serves
one JSON request per connection, and exits when its standard input closes (its client is gone):

- ``{"op": "status"}`` → ``{"pid", "tensorflow", "import_errors", "fork_problem", "threads"}``,
  answered once the imports are done;
- ``{"op": "engine", "args": [...], "env": {...}, "cwd": ..., "log": ...}`` → ``{"pid"}``: a forked
  engine running ``workbench.cluster.launch.engine_main`` with those ipengine arguments;
- ``{"op": "nanny", "kwargs": ...}`` with two file descriptors (the pipe the nanny reports on, and
  where it logs) → ``{"pid"}``: an ipyparallel nanny for an engine forked from here;
- ``{"op": "keep", "seconds": S}`` → the status: its cluster stopped and its client keeps it for the
  next cluster; it exits if no other request comes within ``S`` seconds (any request cancels that).

On an orderly exit (stdin closed, or kept and not asked again) it removes its socket's directory.

Every reply may instead be ``{"error": "..."}``.
"""

from __future__ import annotations

import argparse
import base64
import gc
import importlib
import json
import os
import pickle
import selectors
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import types

from ...compat import ipyparallel as ipp_compat
from .lean_import import keras_companions_left_out
from .warm_client import MAX_MESSAGE, REQUEST_TIMEOUT, WARM_LOG, fork_problem, import_time_mismatch

# Modules every engine needs: imported here once, shared by every fork.
PRELOAD = (
    "tensorflow",
    "keras",
    "cloudpickle",
    "ipyparallel.engine.app",
    "ipyparallel.engine.nanny",
    "ipykernel.debugger",  # ipykernel loads debugpy in every kernel, even with debugging off
    "IPython.core.completerlib",
    "IPython.core.oinspect",
    "tornado.platform.asyncio",
    "IPython.extensions.storemagic",
    "sqlite3",
    "workbench",
    "workbench.cluster.launch.warm_client",  # what an engine forked from here asks of it
    "workbench.cluster.launch.engine_main",
    "workbench.training.strategies.allreduce.engine",
)
def preload(modules: list[str]) -> dict[str, str]:
    """Import ``modules``; return ``{module: error}`` for those that failed."""
    errors = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - a module that fails here fails again, reported, in the engine
            errors[name] = f"{type(exc).__name__}: {exc}"
    return errors


def compact_module_strings() -> int:
    """Re-create ``sys.modules``' keys and each module's ``__file__`` side by side; return how many modules.

    Every ipykernel kernel, so every engine, lists ``sys.modules`` with each module's ``__file__``
    when it starts (for its debugger). In a fork each of those reads writes a reference count, and
    each write copies the whole page the object sits on: the warm process made these strings one
    import at a time, scattered over 3,500 pages (14 MiB). Fresh copies made together fill about 280
    pages: a bare engine's own memory went from 40 to 31 MiB. Run before forking, with no import in
    progress.
    """
    modules = list(sys.modules.items())
    for name, module in modules:
        path = module.__dict__.get("__file__") if isinstance(module, types.ModuleType) else None
        if isinstance(path, str):
            module.__file__ = "".join(list(path))  # an equal, new string
        del sys.modules[name]
        sys.modules["".join(list(name))] = module  # re-inserted in the same order
    return len(modules)


def _set_title(title: str) -> None:
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


class WarmServer:
    """The request loop. Single-threaded: a fork happens between two requests, never during one. ``modules``: the
    user's own preloads, imported after PRELOAD."""

    def __init__(self, path: str, modules: list[str]):
        self.path = path
        self.modules = modules
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(64)
        self.environment = dict(os.environ)
        self.import_errors: dict[str, str] = {}
        self._wake_read, self._wake_write = os.pipe()
        self._inherited = [self.listener.fileno(), self._wake_read, self._wake_write]  # closed in every child
        self.kept_until: float | None = None  # kept for a next cluster: exit at this time unless asked again

    def serve(self) -> None:
        # No collection while importing: TensorFlow's import makes millions of objects, and the
        # collector's passes over them cost 20% of it (measured: 3.2 s -> 2.55 s). It collects
        # little (1,500 objects, no measurable memory), so there is no collection afterwards
        # either. Frozen, those objects stay out of every later collection: an engine's collector
        # never touches, and so never copies, the pages they share with the warm process.
        gc.disable()
        with keras_companions_left_out():  # what Keras loads for a kernel's sake, an engine never uses (lean_import)
            self.import_errors = preload(PRELOAD)
        self.import_errors.update(preload(self.modules))  # the user's own, as they are
        compact_module_strings()
        gc.freeze()
        os.set_blocking(self._wake_write, False)
        signal.set_wakeup_fd(self._wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through the wake-up fd
        selector = selectors.DefaultSelector()
        self._inherited.append(selector.fileno())
        selector.register(self.listener, selectors.EVENT_READ, "request")
        selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "client")
        selector.register(self._wake_read, selectors.EVENT_READ, "child")
        while True:
            if self.kept_until is not None and time.monotonic() >= self.kept_until:
                return  # kept for a next cluster that did not come
            wait = 30.0 if self.kept_until is None else min(30.0, self.kept_until - time.monotonic())
            for key, _ in selector.select(timeout=max(wait, 0.0)):
                if key.data == "client" and not os.read(sys.stdin.fileno(), 4096):
                    return  # the client closed our stdin: it is gone or done with us
                if key.data == "child":
                    os.read(self._wake_read, 4096)
                if key.data == "request":
                    self._answer_one()
            self._reap()

    @staticmethod
    def _reap() -> None:
        while True:
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    def _answer_one(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(REQUEST_TIMEOUT)
            try:
                data, fds, _flags, _addr = socket.recv_fds(conn, MAX_MESSAGE, 4)
            except OSError:
                return
            try:
                reply = self._handle(json.loads(data), fds, conn)
            except Exception as exc:  # noqa: BLE001 - every failure becomes an answer, the loop goes on
                reply = {"error": f"the warm process failed: {type(exc).__name__}: {exc}"}
            finally:
                for fd in fds:
                    os.close(fd)
            try:
                conn.sendall(json.dumps(reply).encode())
            except OSError:
                pass

    def _handle(self, message: dict, fds: list[int], conn: socket.socket) -> dict:
        op = message.get("op")
        self.kept_until = None  # asked again: in use
        if op == "keep":
            self.kept_until = time.monotonic() + float(message["seconds"])
        if op in ("status", "keep"):
            tf = sys.modules.get("tensorflow")
            return {"pid": os.getpid(), "tensorflow": getattr(tf, "__version__", None), "threads": threading.active_count(),
                    "import_errors": self.import_errors, "fork_problem": fork_problem()}
        if op == "engine":
            differ = import_time_mismatch(self.environment, message["env"])
            if differ:
                return {"error": f"the engine's environment sets {', '.join(differ)} differently from the warm process's, "
                                 "and those are read when TensorFlow loads"}
            return self._fork(lambda: self._run_engine(message), [conn.fileno()])
        if op == "nanny":
            if len(fds) != 2:
                return {"error": "a nanny request carries two file descriptors: its report pipe and its log"}
            return self._fork(lambda: self._run_nanny(message, fds), [conn.fileno()], keep=fds)
        return {"error": f"unknown request {op!r}"}

    def _fork(self, body, close: list[int], keep: list[int] = ()) -> dict:
        problem = fork_problem()
        if problem:
            return {"error": problem}
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            return {"pid": pid}
        code = 1
        try:  # the child: never return into the request loop, whatever happens
            self._leave_parent([*self._inherited, *close], keep)
            code = body()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - report it in the child's log, then exit
            traceback.print_exc()
        finally:
            try:
                import atexit

                atexit._run_exitfuncs()  # what a normal exit would run: log handlers, zmq, ...
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code if isinstance(code, int) else 0)

    @staticmethod
    def _leave_parent(close: list[int], keep) -> None:
        """In a new child: its own session, default signal handling, none of the parent's sockets."""
        os.setsid()
        gc.enable()  # the warm process runs without a collector; an engine needs one
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        for fd in close:
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0 now reads /dev/null

    def _run_engine(self, message: dict) -> int:
        log = os.open(message["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.environ.clear()
        os.environ.update(message["env"])
        tempfile.tempdir = None  # read again from this engine's $TMPDIR (its cluster's, not the first cluster's)
        os.chdir(message.get("cwd") or os.getcwd())
        _reseed()
        args = list(message["args"])
        _set_title(f"{sys.executable} -m workbench.cluster.launch.engine_main {' '.join(args)} [forked from {os.getppid()}]")
        from workbench.cluster.launch import engine_main

        sys.argv = [engine_main.__file__, *args]
        engine_main.main(args)
        return 0

    def _run_nanny(self, message: dict, fds: list[int]) -> int:
        report, log = fds
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        kwargs = pickle.loads(base64.b64decode(message["kwargs"]))  # from an engine of this user (private socket)
        _set_title(f"{sys.executable} -m ipyparallel.engine.nanny [engine pid {kwargs.get('pid')}, forked from "
                   f"{os.getppid()}]")
        os.environ["PYTHONUNBUFFERED"] = "1"
        ipp_compat.run_nanny(os.fdopen(report, "w", buffering=1), **kwargs)
        return 0


def _reseed() -> None:
    """Forks share their parent's random state; give each engine its own (Python's ``random`` does it itself)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="the workbench's warm process (see the module docstring)")
    parser.add_argument("--socket", required=True, help="unix socket path to serve requests on")
    parser.add_argument("--preload", action="append", default=[], help="one more module to import before forking")
    args = parser.parse_args(argv)
    _set_title(f"{sys.executable} -m workbench.cluster.launch.warm --socket {args.socket}")
    server = WarmServer(args.socket, args.preload)
    try:
        server.serve()
    finally:
        try:
            os.unlink(args.socket)
        except OSError:
            pass
    _remove_own_directory(args.socket)


def _remove_own_directory(socket_path: str) -> None:
    """After an orderly exit nobody reads the log any more: remove it, and the directory if that leaves it empty
    (the private one its client made; a directory holding anything else stays)."""
    directory = os.path.dirname(socket_path)
    try:
        os.unlink(os.path.join(directory, WARM_LOG))
        os.rmdir(directory)
    except OSError:
        pass


if __name__ == "__main__":
    main()
