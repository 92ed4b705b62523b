"""An ipyparallel engine launcher that forks engines from one warm process (entry point ``fork``).

``wb.Cluster(engines="local")`` uses it. ``ipyparallel.Cluster(engines="workbench-fork")`` works too: every
ipyparallel feature of the local launcher (``engine_args``, ``environment``, signals, stop, the
cluster file) is kept; only how an engine process comes to exist changes. The warm process
(``workbench.cluster.launch.warm``) imports TensorFlow once; each engine is a fork of it, sharing that
memory, and ready in a fraction of a second.

Engines are started the ordinary way (a new Python each, as ipyparallel's ``local`` launcher does)
when forking cannot work, with a one-line notice saying why (``fallback_reason``): not Linux, a
warm process that loaded a GPU driver or runs threads, an environment the warm process was not
started with. ``fork=False`` asks for that explicitly; a custom ``engine_cmd`` implies it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import psutil
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher
from traitlets import Bool, Float, Instance, List, Unicode

from ...compat import ipyparallel as ipp_compat
from ..process.containment import engine_environment
from .engine_main import ENGINE_MAIN, WARM_SOCKET_ENV
from .warm_client import WARM_LOG, WarmError, adopt_import_time, import_time_mismatch, request

STATUS_POLL = 0.05
KEEP_SECONDS = 300.0  # how long a stopped cluster's warm process waits for this client's next cluster
KEEP_CHECK_TIMEOUT = 5.0  # seconds a kept warm process gets to answer whether it can still fork


def fork_unsupported_reason() -> str:
    """Why this platform cannot fork engines, or ``""``."""
    if not sys.platform.startswith("linux"):
        return f"engines are forked on Linux only (this is {sys.platform})"
    return ""


class WarmProcess:
    """The client's handle on one warm process: start it, ask it to fork, stop it."""

    def __init__(self, proc: subprocess.Popen, socket_path: str, log_path: str, env: dict[str, str] | None = None,
                 preload: list[str] = (), cwd: str | None = None):
        self._proc = proc
        self.socket_path = socket_path
        self.log_path = log_path
        self.env = dict(env or {})  # what it was started with: its import-time variables are its forks' too
        self.preload = list(preload)
        self.cwd = cwd or os.getcwd()  # its sys.path[0], so its forks'
        self._status: dict | None = None

    @classmethod
    def start(cls, env: dict[str, str], preload: list[str] = (), cwd: str | None = None) -> WarmProcess:
        """Start a warm process with the engines' environment; returns at once (it imports in the background).

        Its socket and log live in a new private directory (mode 0700: only this user reaches the socket) under
        ``env``'s temporary directory, removed by ``close()`` or by the warm process when it exits.
        """
        directory = tempfile.mkdtemp(prefix="wb-warm-", dir=env.get("TMPDIR") or None)
        socket_path = os.path.join(directory, "socket")
        log_path = os.path.join(directory, WARM_LOG)
        command = [sys.executable, "-m", "workbench.cluster.launch.warm", "--socket", socket_path]
        for module in preload:
            command += ["--preload", module]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                start_new_session=True,  # a Ctrl-C in the client's terminal is not for it
            )
        return cls(proc, socket_path, log_path, env, preload, cwd)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def running(self) -> bool:
        return self._proc.poll() is None

    def last_log_line(self) -> str:
        """The last non-empty line the warm process wrote (its log is removed by ``close()``)."""
        try:
            with open(self.log_path, errors="replace") as handle:
                lines = [line.strip() for line in handle if line.strip()]
        except OSError:
            return "no log"
        return lines[-1] if lines else "empty log"

    def status(self, timeout: float) -> dict:
        """The warm process's answer once its imports are done (raises ``WarmError`` on death or timeout)."""
        if self._status is not None:
            return self._status
        deadline = time.monotonic() + timeout
        while True:
            if not self.running():
                raise WarmError(f"the warm process (pid {self.pid}) exited with code {self._proc.returncode} "
                                f"({self.last_log_line()!r})")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WarmError(f"the warm process (pid {self.pid}) did not finish importing within {timeout:.0f} s")
            if os.path.exists(self.socket_path):  # bound before the imports: the answer comes after them
                try:
                    self._status = request(self.socket_path, {"op": "status"}, timeout=remaining)
                    return self._status
                except WarmError:
                    pass  # not listening yet, or it just died: the checks above tell which
            time.sleep(STATUS_POLL)

    def fork_engine(self, args: list[str], env: dict[str, str], cwd: str, log: str, explicit: dict[str, str] = ()) -> int:
        """Fork one engine running ``engine_main`` with ipengine ``args``; its pid.

        A fork has the libraries the warm process loaded, so the import-time variables (``TF_*``, ``KMP_*``...)
        it runs with are the warm process's: those that this process changed since it started the warm one
        (scikit-learn sets ``KMP_DUPLICATE_LIB_OK`` and ``KMP_INIT_AT_FORK`` when it is imported) are taken
        from the warm process. Only those set for the engines (``explicit``) must agree, or the fork is refused.
        """
        env = {**adopt_import_time(env, self.env, keep=explicit), WARM_SOCKET_ENV: self.socket_path}
        return int(request(self.socket_path, {"op": "engine", "args": args, "env": env, "cwd": cwd, "log": log})["pid"])

    def serves(self, env: dict[str, str], preload: list[str], cwd: str | None) -> bool:
        """Whether engines of this environment, preloads and directory can be its forks."""
        return (self.preload == list(preload) and self.cwd == (cwd or os.getcwd())
                and not import_time_mismatch(self.env, env))

    def keep(self, seconds: float) -> bool:
        """Tell it its cluster stopped: it waits ``seconds`` for the next request, then exits. False if it
        cannot fork any more (or does not answer): then it is of no use to a next cluster."""
        return self._can_fork({"op": "keep", "seconds": seconds})

    def usable(self) -> bool:
        """Whether it still runs and can fork (asking cancels a ``keep``'s exit)."""
        return self._can_fork({"op": "status"})

    def _can_fork(self, message: dict) -> bool:
        """Send ``message`` (answered with the status); whether it runs, answered and can fork."""
        try:
            return self.running() and not request(self.socket_path, message, timeout=KEEP_CHECK_TIMEOUT)["fork_problem"]
        except WarmError:
            return False

    def close(self, timeout: float = 5.0) -> None:
        """Stop the warm process (engines it forked keep running: stop them first) and remove its directory."""
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()  # it exits when its client closes stdin (once its imports are done)
                self._proc.wait(timeout=min(timeout, 1.0))
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()  # it holds nothing worth a graceful exit
                self._proc.wait(timeout=timeout)
        elif self._proc.stdin:
            self._proc.stdin.close()
        shutil.rmtree(os.path.dirname(self.socket_path), ignore_errors=True)


class KeptWarm:
    """The warm process of this client's last stopped cluster, kept for its next one (one at most).

    Starting a cluster costs seconds of TensorFlow import in its warm process; a notebook that stops a
    cluster and starts another (a re-run cell, a sweep over cluster shapes) takes the kept one, whose
    imports are done. It forks nothing while kept, exits after ``KEEP_SECONDS`` unless taken, and exits
    with this process (its standard input closes).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._warm: WarmProcess | None = None

    def keep(self, warm: WarmProcess) -> None:
        """Keep ``warm`` (its cluster stopped, none of its forks runs) for the next cluster, or close it."""
        if not warm.keep(KEEP_SECONDS):
            warm.close()
            return
        with self._lock:
            previous, self._warm = self._warm, warm
        if previous is not None:
            previous.close()

    def take(self, env: dict[str, str], preload: list[str], cwd: str | None = None) -> WarmProcess | None:
        """The kept warm process, if it can fork engines of this environment (it is then no longer kept).

        One that cannot is stopped: the cluster starting now starts its own, and two idle imports of
        TensorFlow would not fit where memory is tight (a Binder session's 2 GiB).
        """
        with self._lock:
            warm, self._warm = self._warm, None
        if warm is None:
            return None
        if warm.serves(env, preload, cwd) and warm.usable():
            return warm
        warm.close()  # another environment, exited on its own (kept too long), or broken
        return None

    @property
    def pid(self) -> int | None:
        """The kept warm process's pid (None when none is kept)."""
        warm = self._warm
        return warm.pid if warm is not None and warm.running() else None

    def release(self) -> None:
        """Stop the kept warm process now (its memory is back at once)."""
        with self._lock:
            warm, self._warm = self._warm, None
        if warm is not None:
            warm.close()


kept_warm = KeptWarm()


class ForkEngineLauncher(LocalEngineLauncher):
    """One engine forked from the parent set's warm process (a new Python if the fork is refused)."""

    def start(self):
        warm = getattr(self.parent, "active_warm", None)
        if warm is None or self.state != "before":
            return super().start()
        env = os.environ.copy()
        env.update(self.get_env())
        try:
            pid = warm.fork_engine(self.args[len(ENGINE_MAIN):], env, self.work_dir, self.output_file,
                                   explicit=self.get_env())
        except WarmError as exc:
            self.parent.note_fallback(str(exc))
            return super().start()
        self.pid = pid
        self.process = psutil.Process(pid)
        self.notify_start(pid)
        ipp_compat.watch_started_process(self)
        return pid


class ForkEngineSetLauncher(LocalEngineSetLauncher):
    """Engines forked from one warm process that imported TensorFlow (see the module docstring)."""

    launcher_class = ForkEngineLauncher
    engine_cmd = List(list(ENGINE_MAIN), config=True, help="command of an engine started without forking")
    delay = Float(0.0, config=True, help="seconds between starting two engines (forks need none)")
    fork = Bool(True, config=True, help="fork engines from a warm process; False starts each as a new Python")
    preload = List(Unicode(), config=True, help="more modules for a warm process this launcher starts to import")
    warm_timeout = Float(300.0, config=True, help="seconds allowed for the warm process's imports")
    warm = Instance(WarmProcess, allow_none=True,
                    help="a running warm process to fork from, owned by the caller (default: start one, owned here)")
    fallback_reason = Unicode("", help="why these engines were not forked ('' when they were)")

    active_warm: WarmProcess | None = None  # the warm process forks come from, once it answered
    _own_warm: WarmProcess | None = None

    def note_fallback(self, reason: str) -> None:
        """Record (once) and log why engines start as new processes."""
        if not self.fallback_reason:
            self.fallback_reason = reason
            self.log.warning("starting engines as new processes instead of forking them: %s", reason)

    def _warm_process(self) -> WarmProcess:
        if self.warm is not None:
            return self.warm
        env = os.environ.copy()
        env.update(self.get_env())
        self._own_warm = WarmProcess.start(env, list(self.preload), cwd=self.work_dir)
        return self._own_warm

    async def start(self, n):
        # the bind shim, loaded at exec by the warm process and by engines started anew (the same variable
        # for both: it is read when libraries load, so forks must agree with their warm process)
        self.environment = engine_environment(dict(self.environment))
        custom = list(self.engine_cmd) != ENGINE_MAIN  # the user's own engine command: run it, no notice
        if self.fork and not custom:
            reason = fork_unsupported_reason()
            if not reason:
                warm = self._warm_process()
                try:
                    status = await asyncio.get_running_loop().run_in_executor(None, warm.status, self.warm_timeout)
                    reason = status["fork_problem"]
                except WarmError as exc:
                    reason = str(exc)
                if not reason:
                    self.active_warm = warm
            if reason:
                self.note_fallback(reason)
                self._stop_own_warm()
        return super().start(n)

    def _stop_own_warm(self) -> None:
        own, self._own_warm = self._own_warm, None
        if own is not None:
            own.close()

    async def stop(self):
        await super().stop()
        self._stop_own_warm()

    def notify_stop(self, data):
        self._stop_own_warm()  # every engine of this set is gone
        return super().notify_stop(data)
