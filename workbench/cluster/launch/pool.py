"""The ipyparallel side of a cluster: engines to host TF tasks, owned or borrowed.

``OwnedPool`` starts a controller and engines through ipyparallel's launchers (local, MPI,
Slurm, SSH, PBS, ...) and guarantees they go away: on ``close()``, and through the reaper and
the engines' lifelines if the client dies. ``AttachedPool`` borrows the engines of an
ipyparallel cluster the user already runs and never stops them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil

from ...compat import ipyparallel as ipp_compat
from ...errors import ClusterStartError, EngineStartTimeout
from ..machine.processes import find_process, process_trees
from ..process.containment import engine_environment
from . import batch, mpi, placement_hosts
from .calls import Deadline, LoopThread
from .engine_main import ENGINE_MAIN, FORKS_ENV
from .launchers import FORK_LAUNCHER, LOCAL_LAUNCHERS, controller_args, engine_launcher_class, is_mpi, split_launcher_options
from .lifeline import LIFELINE_ENV, PREIMPORT_ENV
from .reaper import Reaper, kill_process_trees

POLL_SECONDS = 0.02
CLUSTER_FILE_PREFIX = "workbench-cluster-"  # ipyparallel's cluster file of a workbench cluster, in the profile's security/
HUB_ANSWER_FLOOR = 10.0  # seconds the controller's hub always gets to answer the client (ipyparallel's default)
STOP_GRACE_SECONDS = 1.0  # at stop, how long the controller gets to exit on SIGTERM before SIGKILL


def _launcher_pids(launcher: Any) -> list[int]:
    """Local process ids behind an ipyparallel launcher (none for batch-system launchers).

    An SSH launcher's ``pid`` is the engine's process id on its host, not here: on another machine that
    number names some unrelated process of this one (or none), which stopping the cluster, or the
    reaper after the client died, would kill. Engines reached over SSH are watched as tasks, by the
    host they report (``Hosting.is_local``), and stop through their lifelines and the launcher.
    """
    from ipyparallel.cluster.launcher import SSHLauncher

    pids = []
    pid = getattr(launcher, "pid", -1)
    if isinstance(pid, int) and pid > 0 and not isinstance(launcher, SSHLauncher):
        pids.append(pid)
    for sub in getattr(launcher, "launchers", {}).values():
        pids.extend(_launcher_pids(sub))
    return pids


def _live_controller(cluster_file: Path) -> int:
    """The pid of the controller an ipyparallel cluster file records, if a controller still runs there (0 if not;
    its command line does not name the cluster id)."""
    try:
        pid = int(json.loads(cluster_file.read_text())["controller"]["state"]["pid"])
        cmdline = " ".join(psutil.Process(pid).cmdline())
    except (OSError, ValueError, KeyError, TypeError, psutil.Error):
        return 0
    return pid if "ipyparallel.controller" in cmdline or "ipcontroller" in cmdline else 0


def _quiet_logger() -> logging.Logger:
    """ipyparallel logs every start and stop at INFO; the workbench reports progress itself."""
    log = logging.getLogger("workbench.ipyparallel")
    log.setLevel(logging.ERROR)
    return log


def _output_of(launcher: Any) -> str:
    """What an ipyparallel launcher's process wrote ("" if nothing); a log we cannot read must not hide the real error."""
    try:
        return launcher.get_output() or ""
    except Exception as exc:  # noqa: BLE001 - said in its place instead
        return f"(could not read the launcher's output: {exc})"


def _tail(text: str, lines: int = 25) -> str:
    kept = [line for line in text.splitlines() if line.strip()][-lines:]
    return "\n".join("    " + line for line in kept) if kept else "    (the launcher wrote nothing)"


class OwnedPool:
    """A controller and engines this client started, and will stop."""

    owned = True

    def __init__(
        self,
        *,
        name: str,
        launcher: str,
        controller_ip: str,
        engine_env: dict[str, str],
        preimport: bool,
        cluster_kwargs: dict[str, Any],
        launcher_kwargs: dict[str, Any],
    ):
        self.name = name
        self.launcher = launcher
        self.controller_ip = controller_ip
        self._engine_env = dict(engine_env)
        self._preimport = preimport
        self._cluster_kwargs = cluster_kwargs
        self._launcher_kwargs = launcher_kwargs
        self._loop: LoopThread | None = None
        self._reaper: Reaper | None = None
        self._ipp: Any = None
        self.client: Any = None
        self._watched: dict[int, float] = {}  # the local processes this pool started: pid -> create time
        self._warm: Any = None  # the warm process engines are forked from (fork launcher only)
        self._files_ours = False  # ipyparallel's files for this cluster id: removed at close only if so
        self.scratch = ""  # local engines' temporary directory (autograph's generated files...), removed at close
        if launcher in LOCAL_LAUNCHERS:  # loaded at exec: the warm process, and every engine it forks or that starts anew
            self._engine_env = engine_environment(self._engine_env)
            self.scratch = tempfile.mkdtemp(prefix=f"workbench-{name}-")
            # Engines that end without exit handlers (forks, os._exit) never removed what TensorFlow's autograph
            # wrote to the temporary directory: each cluster's files go to one directory, removed at stop (or
            # by the reaper when this process dies).
            self._engine_env.setdefault("TMPDIR", self.scratch)
        self.fork_notice = ""  # why engines were started as new processes instead of forks ("" if they were not)
        self.launcher_notices: list[str] = []  # what the workbench added to the launcher's options, and why

    @property
    def lifeline(self) -> str:
        return self._reaper.lifeline(self.name) if self._reaper else ""

    def watch(self, pids: Iterable[int]) -> None:
        """Kill these local processes if the client dies; check them on close."""
        for pid in pids:
            proc = find_process(pid)
            if proc is None or self._reaper is None or self._watched.get(pid) == proc.create_time():
                continue  # gone already, nothing to tell, or watched already (a new engine may have a dead one's pid)
            self._watched[pid] = proc.create_time()
            self._reaper.watch(pid)

    def process(self, pid: int) -> psutil.Process | None:
        """The local process ``pid`` if it still runs: the one this pool watched, never a later one with its pid."""
        return find_process(pid, self._watched.get(pid))

    def remove_on_death(self, path: str) -> None:
        if self._reaper:
            self._reaper.remove_on_death(path)

    @property
    def controller_pids(self) -> list[int]:
        """The local processes of the controller (its launcher's), which the reaper reports if they exit."""
        return _launcher_pids(self._ipp.controller) if self._ipp is not None and self._ipp.controller else []

    def health_reports(self) -> Iterator[dict]:
        """The reaper's reports on the engines and the controller, as they come (see ``reaper.py``)."""
        if self._reaper is None:
            return iter(())
        for pid in self.controller_pids:
            self._reaper.health(pid)
        return self._reaper.events()

    def start(self, deadline: Deadline) -> None:
        from ipyparallel import Cluster as IPPCluster

        self._check_mpi()
        self._start_warm()  # first: it imports TensorFlow while everything else starts
        lifeline_host = self.controller_ip if self.controller_ip not in ("", "*", "0.0.0.0") else "0.0.0.0"
        self._reaper = Reaper(lifeline_host)
        if self.scratch:
            self.remove_on_death(self.scratch)
        if self._warm is not None:
            self.watch([self._warm.pid])
            self.remove_on_death(os.path.dirname(self._warm.socket_path))
        self._loop = LoopThread()
        kwargs = dict(self._cluster_kwargs)
        kwargs["controller_args"] = controller_args(kwargs.get("controller_args", []))
        if self.controller_ip:
            kwargs["controller_ip"] = self.controller_ip
        self._ipp = IPPCluster(
            engines=engine_launcher_class(self.launcher),
            cluster_id=self.name,
            shutdown_atexit=False,  # the workbench's own atexit and reaper handle it
            # Local engines read the controller's connection file themselves, so they can be
            # launched while the controller is still starting (their TF import overlaps it).
            # Engines elsewhere get the connection info in their environment instead.
            send_engines_connection_env=self.launcher not in LOCAL_LAUNCHERS,
            log=_quiet_logger(),
            **kwargs,
        )
        # Not security/cluster-<id>.json, which ipyparallel's own JupyterLab panel lists (with a stop button
        # that bypasses the workbench): the workbench's panel shows its clusters. wb.attach reads the
        # path from the registry record.
        self._ipp.cluster_file = str(Path(self._ipp.profile_dir, "security", f"{CLUSTER_FILE_PREFIX}{self.name}.json"))
        self._remove_stale_controller_files()
        self._files_ours = True  # from here on, the files of this cluster id are this pool's
        self._loop.run(self._ipp.start_controller(), deadline.remaining(1))
        for path in self._controller_files():  # a killed kernel leaves them too; the reaper removes them then
            self.remove_on_death(path)
        self.watch(_launcher_pids(self._ipp.controller))
        if self._warm is not None:  # connect while the warm process still imports
            self.client = self._connect_client(deadline)

    def _connect_client(self, deadline: Deadline) -> Any:
        """ipyparallel's client of this cluster's controller. The hub gets what is left of the start's time to answer
        its connection request: ipyparallel's default, 10 s, was too short for a controller just started on a busy
        machine ("Hub connection request timed out", 11 s into a start with two test processes on two cores)."""
        wait = deadline.remaining(HUB_ANSWER_FLOOR)
        try:
            return self._loop.run(self._ipp.connect_client(timeout=wait), wait + 5.0)  # its own error first, if it times out
        except TimeoutError as exc:
            raise ClusterStartError(
                f"the controller's hub did not answer the client within {wait:.0f} s ({exc}); the controller "
                f"{self._controller_state()}. Last lines of its log:\n{_tail(_output_of(self._ipp.controller))}\n"
                "On a busy machine, pass a larger start_timeout; otherwise start the cluster again (a controller that "
                "exited says why above).") from None

    def _controller_state(self) -> str:
        """Whether the controller's process is alive (and how), or gone, for a message."""
        pids = _launcher_pids(self._ipp.controller)
        if not pids:
            return "runs where this process cannot see it"
        try:
            return f"(pid {pids[0]}) is {psutil.Process(pids[0]).status()}"
        except psutil.Error:
            return f"(pid {pids[0]}) has exited"

    def _start_warm(self) -> None:
        if self.launcher != FORK_LAUNCHER or not self._launcher_kwargs.get("fork", True):
            return
        from .fork_launcher import WarmProcess, fork_unsupported_reason, kept_warm

        if fork_unsupported_reason():
            return  # the launcher says so when it starts the engines
        # Only the variables read when TensorFlow loads must match the engines'; each fork gets the rest. Not
        # this cluster's scratch directory: the warm process may be kept for the next cluster, after that is gone.
        env = {**os.environ, **{k: v for k, v in self._engine_env.items() if (k, v) != ("TMPDIR", self.scratch)}}
        preload = list(self._launcher_kwargs.get("preload", []))
        self._warm = kept_warm.take(env, preload) or WarmProcess.start(env, preload)

    def _engine_environment(self) -> dict[str, str]:
        env = {LIFELINE_ENV: self.lifeline, **self._engine_env}
        if self._preimport:
            env[PREIMPORT_ENV] = "1"
        return env

    def _check_mpi(self) -> None:
        """engines='mpi': mpiexec and the engines' mpi4py are there, or a ConfigurationError says what to install."""
        cls = engine_launcher_class(self.launcher)
        if is_mpi(cls):
            mpi.check(self._mpi_cmd(cls), engines_use_this_python="engine_cmd" not in self._launcher_kwargs)

    def _mpi_cmd(self, cls: type) -> list[str]:
        return list(self._launcher_kwargs.get("mpi_cmd") or cls.class_traits()["mpi_cmd"].default())

    def _engine_kwargs(self, n: int, in_use: Mapping[str, int]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"environment": self._engine_environment(), **self._launcher_kwargs}
        if "engines" in kwargs:  # hosts=: reachable hosts, least used first (placement_hosts.py)
            kwargs["engines"] = placement_hosts.place(n, kwargs["engines"], in_use)
            # one command per host: it imports TensorFlow once and forks that host's engines (not with GPUs,
            # chosen per engine before the import; not when env={FORKS_ENV: "1"} asks for a process each)
            if self._preimport and self._engine_env.get(FORKS_ENV) != "1":
                kwargs["engines"] = placement_hosts.one_command_per_host(kwargs["engines"], kwargs["environment"], FORKS_ENV)
        if self.launcher in LOCAL_LAUNCHERS:
            kwargs.setdefault("engine_args", ["--IPEngine.wait_for_url_file=120"])
        if self.launcher == FORK_LAUNCHER:
            if self._warm is not None:
                kwargs["warm"] = self._warm
            else:
                kwargs["fork"] = False  # refused before: no second warm process, no second notice
        cls = self._ipp.engine_launcher_class
        if is_mpi(cls):
            given = list(kwargs.get("mpi_args", []))
            added, notices = mpi.added_args(self._mpi_cmd(cls), given, n)
            kwargs["mpi_args"] = [*added, *given]
            self.launcher_notices.extend(note for note in notices if note not in self.launcher_notices)
        if "batch_file_name" in cls.class_traits() and self._ipp.profile_dir:
            # ipyparallel writes the batch script into the current directory (the user's notebooks) by default
            kwargs.setdefault("batch_file_name", self.batch_file)
        # Engines get the workbench bootstrap (engine_main): launchers that run them with this Python
        # with it, SSH with the remote Python (which has the workbench: its tasks run the workbench's code).
        # A user's own engine_cmd is kept; the lifeline is then attached after registration.
        trait = cls.class_traits().get("engine_cmd")
        if trait is not None and not ipp_compat.computes_engine_command(cls):
            if list(trait.default() or []) == [sys.executable, "-m", "ipyparallel.engine"]:
                kwargs.setdefault("engine_cmd", list(ENGINE_MAIN))
        elif trait is not None and "remote_python" in cls.class_traits():
            remote_python = kwargs.get("remote_python") or cls.class_traits()["remote_python"].default()
            kwargs.setdefault("engine_cmd", [remote_python, *ENGINE_MAIN[1:]])
        return kwargs

    @property
    def batch_file(self) -> str:
        """Where a batch launcher writes its job script: this cluster's own file in the profile directory."""
        return os.path.join(self._ipp.profile_dir, f"workbench-{self.name}-engines.batch")

    def add_engines(self, n: int, deadline: Deadline, on_progress, in_use: Mapping[str, int] | None = None) -> list[int]:
        """Start ``n`` engines; return their ids once all registered.

        ``in_use``: running tasks per host (by name and by address), for launchers given ``hosts=``.
        """
        before = set(self.client.ids) if self.client is not None else set()
        kwargs = self._engine_kwargs(n, in_use or {})
        set_id = self._loop.run(self._ipp.start_engines(n, **kwargs), deadline.remaining(1))
        engine_set = self._ipp.engines[set_id]
        self.watch(_launcher_pids(engine_set))
        self._after_fallback(getattr(engine_set, "fallback_reason", ""))
        if self.client is None:
            self.client = self._connect_client(deadline)
        while True:
            new = sorted(set(self.client.ids) - before)
            on_progress(len(new), n)
            if len(new) >= n:
                return new[:n]
            stopped = getattr(engine_set, "state", "") == "after"
            if stopped or deadline.expired:
                why = "the engine launcher stopped" if stopped else f"within {deadline.seconds:.0f} s"
                job = batch.describe(engine_set)
                raise EngineStartTimeout(
                    f"only {len(new)} of {n} engine(s) registered ({why}) with launcher "
                    f"{self.launcher!r}.{' ' + job if job else ''} Last lines of the launcher's log:\n"
                    f"{_tail(self.log_tail(set_id))}\n"
                    "Fix what the log shows; if the engines are merely slow to start (a busy batch queue), "
                    "pass a larger start_timeout."
                )
            time.sleep(POLL_SECONDS)

    def _after_fallback(self, reason: str) -> None:
        """Engines were started as new processes: say why once, and free the warm process's memory."""
        if not reason:
            return
        self.fork_notice = self.fork_notice or reason
        warm, self._warm = self._warm, None
        if warm is not None:
            warm.close()

    def log_tail(self, set_id: str | None = None) -> str:
        sets = [self._ipp.engines[set_id]] if set_id else list(self._ipp.engines.values())
        return "\n".join(_output_of(engine_set) for engine_set in sets)

    def remove_engines(self, engine_ids: list[int], pids: list[int], deadline: Deadline) -> None:
        """Shut these engines down and wait until they left the controller."""
        engine_ids = [e for e in engine_ids if e in self.client.ids]  # a dead engine left already
        if engine_ids:
            self.client.shutdown(targets=engine_ids, hub=False, block=False)
        while set(engine_ids) & set(self.client.ids) and not deadline.expired:
            time.sleep(POLL_SECONDS)
        if pids:
            kill_process_trees([(pid, self._watched.get(pid, 0.0)) for pid in pids], grace=min(10.0, deadline.remaining(1)))

    def close(self, timeout: float = 60.0) -> None:
        """Stop everything this pool started; leaves no process behind."""
        deadline = Deadline(timeout)
        # Engines' nannies are their children; once an engine exits they are re-parented, so
        # collect the whole tree now and make sure all of it is gone at the end.
        tree = process_trees(self._watched.items())
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001 - closing sockets of a dead cluster may fail; keep going
                pass
            self.client = None
        # Engines and their nannies are killed at once: they hold nothing a graceful shutdown would save,
        # TF servers cannot shut down cleanly anyway, and none of them exits on SIGTERM (measured: every one
        # sat out a second's grace, with or without a job). The controller exits on SIGTERM, removing its
        # files: it gets a grace. The warm process goes after its forks: it reaps them as they die (orphans
        # wait for whatever init reaps them: a second and more here). The watched pids too, alive or not:
        # what a killed controller forked is left in its process group.
        controller_ids = {pid: self._watched.get(pid, 0.0) for pid in self.controller_pids}
        controller = {p.pid: p.create_time() for p in process_trees(controller_ids.items())}
        later = set(controller) | ({self._warm.pid} if self._warm is not None else set())
        kill_process_trees([(p.pid, p.create_time()) for p in tree if p.pid not in later]
                           + [(pid, created) for pid, created in self._watched.items() if pid not in later], grace=0.0)
        kill_process_trees(list(controller.items()), grace=min(STOP_GRACE_SECONDS, deadline.remaining(1)))
        if self._ipp is not None and self._loop is not None and self._files_ours:
            try:  # ipyparallel's bookkeeping: connection and cluster files, logs
                self._loop.run(self._ipp.stop_cluster(), deadline.remaining(5))
            except Exception:  # noqa: BLE001 - the processes are gone already; files are secondary
                pass
            for path in self._controller_files():  # a killed controller removed none of them
                Path(path).unlink(missing_ok=True)
            if self._ipp.profile_dir:
                Path(self.batch_file).unlink(missing_ok=True)
        if self._warm is not None:  # its forks are gone: kept for this client's next cluster (fork_launcher.KeptWarm)
            from .fork_launcher import kept_warm

            kept_warm.keep(self._warm)
            self._warm = None
        if self._reaper is not None:
            self._reaper.close(release=True)
            self._reaper = None
        if self._loop is not None:
            self._loop.close()
            self._loop = None
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
        self._ipp = None

    def _controller_files(self) -> list[str]:
        """What ipyparallel keeps on disk for this cluster id: its cluster file, the controller's connection
        files and the hub's engine record. A clean controller exit removes them; a killed one leaves them."""
        profile = getattr(self._ipp, "profile_dir", "")
        if not profile:
            return []
        security = Path(profile, "security")
        return [str(security / f"{CLUSTER_FILE_PREFIX}{self.name}.json"), str(security / f"cluster-{self.name}.json"),
                *(str(security / f"ipcontroller-{self.name}-{kind}.json") for kind in ("client", "engine")),
                str(Path(profile, "log", f"engines{self.name}.json"))]

    def _remove_stale_controller_files(self) -> None:
        """Files left by a dead controller of this name. Left in place, the new cluster read the old connection
        file before its own controller wrote one and its client timed out ("Hub connection request timed out")."""
        files = self._controller_files()
        if not files:
            return
        for recorded in files[:2]:  # a workbench cluster's file, or plain ipyparallel's of the same id
            pid = _live_controller(Path(recorded))
            if pid:
                raise ClusterStartError(
                    f"an ipyparallel controller for cluster id {self.name!r} is already running (pid {pid}, recorded in "
                    f"{recorded}); give this cluster another name, or stop that one first "
                    f"(`ipcluster stop --cluster-id={self.name}`).")
        for path in files:
            Path(path).unlink(missing_ok=True)

    @property
    def cluster_file(self) -> str:
        return getattr(self._ipp, "cluster_file", "") if self._ipp else ""

    @property
    def profile_dir(self) -> str:
        return getattr(self._ipp, "profile_dir", "") if self._ipp else ""


def owned_pool_factory(name: str, engines: str, controller_ip: str | None, engine_env: Callable[[], dict[str, str]],
                       preimport: bool, launcher_options: dict[str, Any]) -> tuple[Callable[[], OwnedPool], bool]:
    """How a cluster's own engines will start, checked now (a wrong launcher or option fails at construction).

    Returns a factory of the ``OwnedPool`` (called by ``start()``) and whether its engines are forked from a
    warm process (``engines="local"`` unless ``fork=False``). ``engine_env`` is read when the pool is made.
    """
    ipp_launcher = FORK_LAUNCHER if engines == "local" else engines  # local engines are forks (fork_launcher.py)
    cluster_kwargs, launcher_kwargs = split_launcher_options(engine_launcher_class(ipp_launcher), launcher_options)
    if controller_ip is None:
        controller_ip = "127.0.0.1" if engines in LOCAL_LAUNCHERS else ""

    def factory() -> OwnedPool:
        return OwnedPool(name=name, launcher=ipp_launcher, controller_ip=controller_ip, engine_env=engine_env(),
                         preimport=preimport, cluster_kwargs=cluster_kwargs, launcher_kwargs=launcher_kwargs)

    return factory, ipp_launcher == FORK_LAUNCHER and launcher_kwargs.get("fork", True)


def local_hostnames() -> set[str]:
    names = {socket.gethostname(), "localhost"}
    try:
        names.add(socket.getfqdn())
    except OSError:
        pass
    return names
