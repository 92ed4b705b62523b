"""``wb.Cluster``: an ipyparallel engine pool whose engines host TensorFlow ``ps`` and ``worker`` tasks."""

from __future__ import annotations

import atexit
import os
import re
import secrets
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import psutil

from ..errors import (
    ClusterStartError,
    ClusterStateError,
    ConfigurationError,
    ControllerLost,
    EngineForkWarning,
    LauncherOptionsWarning,
    LowMemoryWarning,
    TaskFaultWarning,
    UnknownTaskError,
    WorkbenchError,
)
from ..native_logs import notice
from ..progress import ProgressSink, make_progress
from ..telemetry.clocks import measure_offsets
from ..telemetry.forwarding import TelemetryForwarder
from ..telemetry.log import EventLog
from . import registry
from .health import LOST, RECOVERING, RUNNING, SILENT, STOPPED, TaskHealth
from .hosting import TaskHosting
from .jobs import JobList, JobQueue
from .launch.pool import (
    FORK_LAUNCHER,
    LOCAL_LAUNCHERS,
    AttachedPool,
    Deadline,
    OwnedPool,
    attach_client,
    engine_launcher_class,
    split_launcher_options,
)
from .links import LinkShaping
from .machine.gpus import discover_gpus, validate_gpus_per_worker
from .machine.memory import available_memory, engine_memory_warning
from .machine.versions import client_tensorflow_version, workbench_version
from .registry import ClusterRecord, Endpoint
from .spec import TaskId, cluster_spec_dict, role_layout, validate_counts
from .status import ClusterStatus, TaskRecord

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# Strong references: a running cluster stays reachable (for running_clusters(), the magics and the
# stop at exit) until it is stopped, even if the code that started it dropped its variable.
_LIVE_CLUSTERS: set = set()


def running_clusters() -> list[Cluster]:
    """The clusters this process started (or borrowed) and has not stopped, oldest first."""
    return sorted((c for c in _LIVE_CLUSTERS if c.state == "running"), key=lambda c: c._started_at)


def _stop_live_clusters() -> None:
    for cluster in list(_LIVE_CLUSTERS):
        try:
            cluster.stop()
        except Exception:  # noqa: BLE001 - at exit, stop what can be stopped; the reaper does the rest
            pass


atexit.register(_stop_live_clusters)


class Cluster(TaskHosting, LinkShaping):
    """A pool of ipyparallel engines, each hosting one TensorFlow task (``ps:i`` or ``worker:j``).

    The notebook kernel (or script) that creates it is the client and coordinator::

        import workbench as wb
        with wb.Cluster(ps=1, workers=2) as cluster:
            print(cluster.spec)       # tf.train.ClusterSpec
            cluster.status()          # a table: text in a terminal, HTML in a notebook

    Parameters
    ----------
    ps, workers:
        Number of parameter-server tasks (>= 0) and worker tasks (>= 1).
    engines:
        ipyparallel engine launcher: ``"local"`` (default, this machine), ``"mpi"``, ``"slurm"``,
        ``"ssh"``, ``"pbs"``, ... Options of that launcher (``queue=``, ``mpi_args=``, ...) and of
        ``ipyparallel.Cluster`` (``profile=``, ``controller_args=``, ...) pass through as keywords.
        For ``"ssh"``, ``hosts={"node1": 2, "user@node2:2222": 2}`` says how many engines each host
        runs (the SSH launcher's own ``engines`` option, renamed because ``engines=`` names the launcher).
    gpus_per_worker:
        GPUs given to each worker through ``CUDA_VISIBLE_DEVICES``, disjoint between engines on
        the same host; ps tasks get none. 0 (default) hides every GPU from every task.
    name:
        Name in the registry and ipyparallel cluster id (default: ``wb-`` and six random letters).
    controller_ip:
        Address the controller and the lifeline listen on; default ``127.0.0.1`` for local engines.
        Remote launchers need an address the engines can reach.
    start_timeout:
        Seconds allowed for ``start()`` (and each ``scale()``) as a whole.
    env:
        Extra environment variables for the engines.
    progress:
        ``True``: a bar in a notebook, text in a terminal; ``False``: quiet; or a ``ProgressSink``.
    network:
        Emulated links between the tasks, which ``shape()`` sets while they run: ``"auto"`` (unshaped
        until then), a rate for every link from the start (``"1gbit"``), or
        ``dict(rate=, delay=, between=, backend=)``. Backends: ``"netns"`` (a network namespace per
        task, ``tc`` on its veth; root, Linux; delay only where the kernel has netem), ``"user"`` (a
        relay process; no root), ``"auto"`` (netns where it can run, else user); ``status()`` names
        the one in use. Local engines only. Default: none (tasks talk directly, as without the
        workbench).
    """

    # Called with every cluster this process starts, once its tasks run (a failure stops the cluster).
    # Higher layers add theirs here (``workbench.control`` adds the owner's control endpoint), so the
    # engine pool knows nothing of what they are; they keep what must close with it (``keep``).
    start_hooks: ClassVar[list[Callable[[Cluster], None]]] = []

    def __init__(
        self,
        ps: int = 1,
        workers: int = 2,
        *,
        engines: str = "local",
        gpus_per_worker: int = 0,
        name: str | None = None,
        controller_ip: str | None = None,
        start_timeout: float = 300.0,
        env: Mapping[str, str] | None = None,
        progress: bool | ProgressSink = True,
        network: Any = None,
        **launcher_options: Any,
    ):
        validate_counts(ps, workers)
        self._gpus_per_worker = validate_gpus_per_worker(gpus_per_worker)
        self.name = self._validate_name(name)
        if not isinstance(start_timeout, (int, float)) or isinstance(start_timeout, bool) or start_timeout <= 0:
            raise ConfigurationError(f"start_timeout={start_timeout!r} must be a positive number of seconds.")
        self._start_timeout = float(start_timeout)
        self._progress_option = progress
        self._ps, self._workers = ps, workers
        self._env = {str(k): str(v) for k, v in (env or {}).items()}
        self._tasks: dict[TaskId, TaskRecord] = {}
        self._state = "new"
        self._started_at = 0.0
        self._pool: OwnedPool | AttachedPool | None = None
        self._pool_factory: Callable[[], OwnedPool | AttachedPool]
        self.telemetry = EventLog()  # step spans and progress of every job on this cluster (wb.dashboard)
        self.job_queue = JobQueue(self.name)  # this process's training jobs on the cluster, one running at a time
        self._lifecycle = threading.RLock()  # start/scale/stop, from the kernel or the control thread
        # What higher layers (control endpoint, dashboards, widgets) keep with this cluster: key -> (resource, close)
        self._kept: dict[str, tuple[Any, Callable[[], None] | None]] = {}
        self._endpoints: dict[str, Endpoint] = {}  # what they serve for other processes, in the registry record
        self.last_profile = None  # the newest cluster.profile(), for the served /profile page
        self._clock_offsets: tuple[float, dict[str, float]] | None = None
        self._owner_pid = 0  # set by attach(): the process that runs this cluster
        self._forks = False  # local engines are forked from a warm process (unless that is refused)
        # the tasks' health, followed as it changes (owned pools: the reaper's reports); jobs subscribe to it
        self.health = TaskHealth(self.name, lambda: self.tasks, self._publish_tasks, self.telemetry)
        self.failure = ""  # why the cluster failed while running (its controller exited), if it did
        if engines is None:  # set by from_existing or attach
            self._init_network(None, False)
            return
        # "local" engines are forked from a warm process that imported TensorFlow (fork_launcher.py)
        ipp_launcher = FORK_LAUNCHER if engines == "local" else engines
        launcher_cls = engine_launcher_class(ipp_launcher)
        cluster_kwargs, launcher_kwargs = split_launcher_options(launcher_cls, launcher_options)
        local = engines in LOCAL_LAUNCHERS
        if controller_ip is None:
            controller_ip = "127.0.0.1" if local else ""
        if local:
            self._check_local_gpus(workers)
        self._init_network(network, local)
        self._launcher = engines
        self._forks = ipp_launcher == FORK_LAUNCHER and launcher_kwargs.get("fork", True)
        self._pool_factory = lambda: OwnedPool(
            name=self.name,
            launcher=ipp_launcher,
            controller_ip=controller_ip,
            engine_env=self._engine_env(),
            preimport=self._gpus_per_worker == 0,
            cluster_kwargs=cluster_kwargs,
            launcher_kwargs=launcher_kwargs,
        )

    # -- construction helpers -------------------------------------------------------------

    @staticmethod
    def _validate_name(name: str | None) -> str:
        if name is None:
            return "wb-" + "".join(secrets.choice("abcdefghijkmnpqrstuvwxyz23456789") for _ in range(6))
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ConfigurationError(
                f"name={name!r} is not a valid cluster name: use 1-64 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit."
            )
        return name

    def _engine_env(self) -> dict[str, str]:
        env = {"TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1")}
        env.update(self._env)
        return env

    def _warn_if_memory_short(self, engines: int, stacklevel: int = 3) -> None:
        """Warn, pointing at the user's call (``stacklevel`` for ``warnings.warn``), when local engines may not fit in memory."""
        if self._launcher in LOCAL_LAUNCHERS:  # engines elsewhere use their nodes' memory
            forked = self._forks and not (self._pool is not None and self._pool.fork_notice)
            first = self._pool is None  # start(): the warm process is yet to come
            message = engine_memory_warning(engines, *available_memory(), forked=forked, with_warm=forked and first)
            if message:
                warnings.warn(f"cluster {self.name!r}: {message}", LowMemoryWarning, stacklevel=stacklevel)

    def _warn_if_not_forked(self, known: str, stacklevel: int = 3) -> None:
        """The one-line notice when local engines were started as new processes instead of forks."""
        notice = getattr(self._pool, "fork_notice", "")
        if notice and notice != known:
            warnings.warn(f"cluster {self.name!r}: engines start as separate processes, each importing TensorFlow "
                          f"(more memory, slower start), because {notice}", EngineForkWarning, stacklevel=stacklevel)

    def _warn_launcher_notices(self, known: int, stacklevel: int = 3) -> None:
        """One warning per option the workbench added to the launcher's command since ``known`` notices."""
        for added in getattr(self._pool, "launcher_notices", [])[known:]:
            warnings.warn(f"cluster {self.name!r}: {added}", LauncherOptionsWarning, stacklevel=stacklevel)

    def _check_local_gpus(self, workers: int) -> None:
        if not self._gpus_per_worker:
            return
        merged = {**os.environ, **self._env}
        available = discover_gpus(merged)
        needed = workers * self._gpus_per_worker
        if needed > len(available):
            raise ConfigurationError(
                f"{workers} worker(s) x gpus_per_worker={self._gpus_per_worker} need {needed} GPU(s), but this "
                f"machine has {f'{len(available)} {available}' if available else 'none'}: lower gpus_per_worker or workers, or use "
                "gpus_per_worker=0 to train on CPUs."
            )

    @classmethod
    def from_existing(
        cls,
        source: Any = None,
        *,
        ps: int = 1,
        workers: int = 2,
        profile: str | None = None,
        cluster_id: str | None = None,
        name: str | None = None,
        start_timeout: float = 120.0,
        progress: bool | ProgressSink = True,
    ) -> Cluster:
        """Give TF roles to the engines of an ipyparallel cluster the user already runs.

        ``source`` is an ``ipyparallel.Cluster`` or ``ipyparallel.Client``; or leave it out and
        name the cluster with ``profile=``/``cluster_id=``. Call ``start()`` next. ``stop()`` then
        releases the roles and leaves the engines running (their TF servers keep listening until
        the engines restart: TensorFlow cannot stop a server inside a running process).
        """
        cluster = cls(ps, workers, engines=None, name=name, start_timeout=start_timeout, progress=progress)
        cluster._launcher = "existing"

        def factory() -> AttachedPool:
            client, created, ipp_cluster = attach_client(source, profile, cluster_id, start_timeout)
            return AttachedPool(client, close_client=created, cluster=ipp_cluster)

        cluster._pool_factory = factory
        return cluster

    @classmethod
    def attach(cls, name: str, *, timeout: float = 60.0) -> Cluster:
        """Use, from this process, a cluster that another one runs (a notebook kernel, the Workbench panel).

        The attached object trains, places ops, profiles and shows dashboards like the owner's.
        It does not own the cluster: ``stop()`` only disconnects this process, and scaling or
        stopping the cluster is done by its owner (or from the Workbench panel).
        """
        import ipyparallel as ipp

        records = {r.name: r for r in registry.list_clusters()}
        record = records.get(name)
        if record is None:
            running = ", ".join(records) or "none"
            raise ClusterStateError(f"no running cluster named {name!r} on this machine (running: {running}). Start "
                                    "one with wb.Cluster(...).start() or from the Workbench panel.")
        if record.client_pid == os.getpid():
            raise ClusterStateError(f"cluster {name!r} runs in this very process: use that object "
                                    f"(wb.running_clusters() lists it).")
        if not record.cluster_file:
            raise ClusterStateError(f"cluster {name!r} borrows the engines of an ipyparallel cluster it does not own: "
                                    "connect to that one with wb.Cluster.from_existing(...) instead.")
        cluster = cls(len(record.spec.get("ps", [])), len(record.spec.get("worker", [])), engines=None, name=name,
                      progress=False)
        try:
            client = ipp.Cluster.from_file(record.cluster_file).connect_client_sync(timeout=timeout)
        except (OSError, TimeoutError, ValueError) as exc:
            raise ClusterStateError(f"could not connect to cluster {name!r}'s controller ({exc}); its owner (pid "
                                    f"{record.client_pid}) may be stopping it.") from None
        cluster._launcher = record.engines
        cluster._owner_pid = record.client_pid
        cluster._pool = AttachedPool(client, close_client=True, launcher=cluster._launcher)
        cluster._tasks = {r.task: r for r in record.tasks}
        cluster._client_tf_version = client_tensorflow_version()
        cluster._state = "running"
        cluster._started_at = time.monotonic()
        _LIVE_CLUSTERS.add(cluster)
        # this process's jobs go to the owner's telemetry too: its dashboards and the panel show them
        forwarder = TelemetryForwarder(name, cluster.telemetry, lambda: registry.endpoint(name, "control")).start()
        cluster.keep("telemetry-forwarder", forwarder, close=forwarder.stop)
        return cluster

    @property
    def attached(self) -> bool:
        """True for a cluster from ``attach()``: another process owns it."""
        return bool(self._owner_pid)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> Cluster:
        """Start the engines and one TF server per task; return when every server is up.

        On any failure everything already started is stopped before the error is raised. When local
        engines may not fit in the memory left (machine or container), a ``LowMemoryWarning`` is
        issued before the first one starts.
        """
        if self._state != "new":
            raise ClusterStateError(
                f"cluster {self.name!r} is {self._state}; a Cluster starts once. Create a new wb.Cluster(...)."
            )
        self._refuse_a_running_name()
        progress = make_progress(self._progress_option)
        deadline = Deadline(self._start_timeout)
        self._state = "starting"
        self._client_tf_version = client_tensorflow_version()
        try:
            layout = role_layout(self._ps, self._workers)
            self._warn_if_memory_short(len(layout))
            self._pool = self._pool_factory()
            self._pool.start(deadline)
            self._pool.remove_on_death(str(registry.registry_path(self.name)))
            ids = self._pool.add_engines(
                len(layout), deadline, lambda done, total: progress.update("engines registered", done, total)
            )
            self._warn_if_not_forked("")
            self._warn_launcher_notices(0)
            self._open_links()
            self._assign_tasks(dict(zip(layout, ids)), deadline, progress)
            self.check_exposure(self.tasks, deadline, stacklevel=3)
            self._state = "running"
            self.health.follow(self._pool.health_reports(), self._pool.controller_pids, self._controller_lost)
            for hook in self.start_hooks:
                hook(self)
        except BaseException as exc:
            progress.close(f"cluster {self.name!r} failed to start", ok=False)
            self._teardown()
            self._state = "failed"
            if isinstance(exc, WorkbenchError) or not isinstance(exc, Exception):
                raise
            raise ClusterStartError(f"starting cluster {self.name!r} failed: {type(exc).__name__}: {exc}") from exc
        self._state = "running"
        self._started_at = time.monotonic()
        _LIVE_CLUSTERS.add(self)
        self._write_registry()
        progress.close(
            f"cluster {self.name!r} ready: {self._ps} ps + {self._workers} worker task(s) "
            f"in {deadline.seconds - deadline.remaining():.1f} s"
        )
        return self

    def _refuse_a_running_name(self) -> None:
        """A second cluster of a running one's name would share its registry record and ipyparallel files."""
        record = registry.read_record(self.name)
        if record is not None and record.client_alive():
            raise ClusterStartError(
                f"a cluster named {self.name!r} is already running (owned by process {record.client_pid}): "
                f"give this one another name, e.g. wb.Cluster(..., name={self.name + '-2'!r}), or stop that one first."
            )

    def stop(self, timeout: float = 60.0) -> None:
        """Stop every task and everything this cluster started. Safe to call twice.

        Jobs go first: queued ones are cancelled and the running one stops after its calls in flight
        (each line of what was done is printed), so no job sees its tasks vanish under it.
        """
        with self._lifecycle:
            if self._state == "new":
                return
            if self._state in ("stopped", "failed"):
                self._state = "stopped"
                return
            for line in self.job_queue.stop_all(min(timeout, 60.0)):
                print(f"cluster {self.name!r}: {line}")
            from .process import connection

            connection.release(self)
            self._teardown(timeout)
            self._state = "stopped"

    @property
    def log_path(self) -> str:
        """Where this kernel's TensorFlow, absl and gRPC lines go while it is a client of this cluster.

        In a Jupyter kernel those C++ lines are kept out of cells (``wb.native_logs``); from the first
        connection to this cluster (its first job, ``connect()``, ``%%wb on``) they go to this file under
        ``~/.cache/workbench/logs/``, one per cluster and kernel, kept after the cluster stops: start-up
        lines, gRPC's "Failed to connect" while a task is re-hosted, destructors after a stop. ``""``
        outside a kernel (a script keeps its stderr) or with ``WORKBENCH_NATIVE_LOGS=cell``.
        """
        from .. import native_logs

        return native_logs.cluster_log_path(self.name)

    @property
    def scratch(self) -> str:
        """The temporary directory of this cluster's local engines and warm process, removed at stop ("" if none)."""
        return getattr(self._pool, "scratch", "") or ""

    @property
    def jobs(self) -> JobList:
        """This process's training jobs on the cluster, oldest first, with their states (queued, running, stopping,
        finished, failed, cancelled); ``cluster.jobs["async-ps-3"]`` finds one by name. One runs at a time."""
        return self.job_queue.all()

    def _teardown(self, timeout: float = 60.0) -> None:
        self.health.closing = True  # the engines stopped from here on are not "lost"
        self._close_kept()
        pool, self._pool = self._pool, None
        if self.attached:  # only this process's connection ends; the owner keeps the cluster
            if pool is not None:
                pool.close(timeout)
            _LIVE_CLUSTERS.discard(self)
            return
        if pool is not None:
            if not pool.owned and self._tasks:
                try:
                    pool.remove_engines([r.engine_id for r in self._tasks.values()], [], Deadline(min(timeout, 15)))
                except Exception:  # noqa: BLE001 - borrowed engines may already be gone
                    pass
            pool.close(timeout)
        # after the engines: a task's connections to this kernel must close while its link still carries the
        # close (a namespace removed first leaves the kernel's TensorFlow waiting on peers that never answer)
        self._close_links()
        for record in self._tasks.values():
            record.state = "stopped"
        registry.remove_record(self.name)
        _LIVE_CLUSTERS.discard(self)

    def __enter__(self) -> Cluster:
        if self._state == "new":
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def scale(self, workers: int | None = None, ps: int | None = None) -> Cluster:
        """Add or remove worker tasks while running (the highest indices go first).

        The number of ps tasks is fixed while running: variables live on them.
        """
        with self._lifecycle:
            return self._scale(workers, ps)

    def _scale(self, workers: int | None, ps: int | None) -> Cluster:
        self._require_running("scale")
        if self.attached:
            raise ClusterStateError(f"cluster {self.name!r} is attached: process {self._owner_pid} owns it. Scale it "
                                    "there, or from the Workbench panel.")
        if ps is not None and ps != self._ps:
            raise ConfigurationError(
                f"ps={ps}: the number of ps tasks cannot change while the cluster runs (model variables live on "
                f"them). Stop the cluster and start a new one with ps={ps}."
            )
        workers = self._workers if workers is None else workers
        validate_counts(self._ps, workers)
        deadline = Deadline(self._start_timeout)
        if workers > self._workers:
            if self._launcher in LOCAL_LAUNCHERS:
                self._check_local_gpus(workers)
            new_tasks = [TaskId("worker", i) for i in range(self._workers, workers)]
            self._warn_if_memory_short(len(new_tasks), stacklevel=4)
            progress = make_progress(self._progress_option)
            try:
                known = getattr(self._pool, "fork_notice", "")
                noted = len(getattr(self._pool, "launcher_notices", []))
                ids = self._add_engines(len(new_tasks), deadline, progress)
                self._warn_if_not_forked(known, stacklevel=4)
                self._warn_launcher_notices(noted, stacklevel=4)
                self._assign_tasks(dict(zip(new_tasks, ids)), deadline, progress)
                self.check_exposure([self._tasks[t] for t in new_tasks], deadline, stacklevel=4)
            except BaseException:
                progress.close("scaling failed", ok=False)
                self._drop_tasks([t for t in new_tasks if t in self._tasks], deadline)
                raise
            progress.close(f"cluster {self.name!r} now has {workers} worker task(s)")
        elif workers < self._workers:
            self._drop_tasks([TaskId("worker", i) for i in range(workers, self._workers)], deadline)
        self._workers = workers
        self._clock_offsets = None  # new tasks: measure again
        self._write_registry()
        return self

    def _add_engines(self, n: int, deadline: Deadline, progress: ProgressSink) -> list[int]:
        def report(done: int, total: int) -> None:
            progress.update("engines registered", done, total)

        if isinstance(self._pool, AttachedPool):
            used = [r.engine_id for r in self._tasks.values()]
            return self._pool.add_engines(n, deadline, report, exclude=used)
        return self._pool.add_engines(n, deadline, report, in_use=self._tasks_per_host())

    def _tasks_per_host(self) -> dict[str, int]:
        """Running tasks per host, counted under its name and under its address (a lost task no longer counts)."""
        counts: dict[str, int] = {}
        for record in self._tasks.values():
            if record.state in (LOST, RECOVERING, STOPPED):
                continue
            for key in {record.host, record.address.rpartition(":")[0].strip("[]")} - {""}:
                counts[key] = counts.get(key, 0) + 1
        return counts

    def _drop_tasks(self, tasks: list[TaskId], deadline: Deadline) -> None:
        records = [self._tasks.pop(t) for t in tasks]
        self._pool.remove_engines([r.engine_id for r in records], [r.pid for r in records if self._is_local(r)], deadline)

    # -- what higher layers attach ---------------------------------------------------------

    def keep(self, key: str, resource: Any, close: Callable[[], None] | None = None) -> Any:
        """Hold ``resource`` (a server, a widget, ...) under ``key`` until this cluster stops, then call ``close``.

        For the layers above the engine pool (control endpoint, dashboards): what they start for a
        cluster ends with it. Keeping a new resource under a key in use closes the old one first.
        """
        self.release(key, close=True)
        self._kept[key] = (resource, close)
        return resource

    def kept(self, key: str, default: Any = None) -> Any:
        """The resource kept under ``key``, or ``default``."""
        entry = self._kept.get(key)
        return entry[0] if entry is not None else default

    def release(self, key: str, close: bool = False) -> Any:
        """Stop holding the resource under ``key`` (closing it if ``close``); returns it, or None."""
        resource, closer = self._kept.pop(key, (None, None))
        if close and closer is not None:
            closer()
        return resource

    def advertise(self, name: str, endpoint: Endpoint | None) -> None:
        """Publish (or with ``None`` withdraw) what this process serves for the cluster, in its registry record."""
        if endpoint is None:
            self._endpoints.pop(name, None)
        else:
            self._endpoints[name] = endpoint
        if self._state == "running":
            self._write_registry()

    def _close_kept(self) -> None:
        """Close what higher layers kept, newest first; one that fails does not stop the others."""
        while self._kept:
            key = next(reversed(self._kept))
            try:
                self.release(key, close=True)
            except Exception:  # noqa: BLE001 - stopping must go on; the resource is gone with the cluster anyway
                pass
        self._endpoints.clear()

    # -- what users read -------------------------------------------------------------------

    def _require_running(self, what: str) -> None:
        if self.failure:
            raise ControllerLost(f"cannot {what}: {self.failure}")
        if self._state != "running":
            raise ClusterStateError(
                f"cannot {what}: cluster {self.name!r} is {self._state}. "
                + ("Call cluster.start() first." if self._state == "new" else "Start a new wb.Cluster(...).")
            )

    @property
    def state(self) -> str:
        return self._state

    @property
    def tasks(self) -> list[TaskRecord]:
        """One record per task (job, index, engine id, address, pid, devices, GPUs, state), ps first."""
        records = dict(self._tasks)  # one copy (atomic): the health monitor reads while start/scale/re-host write
        return [records[t] for t in sorted(records)]

    def task(self, name: str | TaskId) -> TaskRecord:
        """The record of ``"worker:1"``; ``UnknownTaskError`` names the tasks that exist."""
        task = TaskId.parse(name)
        if task not in self._tasks:
            raise UnknownTaskError(
                f"cluster {self.name!r} has no task {task}: its tasks are {', '.join(r.name for r in self.tasks) or 'none'}."
            )
        return self._tasks[task]

    @property
    def spec_dict(self) -> dict[str, list[str]]:
        """``{"ps": [...], "worker": [...]}`` addresses."""
        return cluster_spec_dict({t: r.address for t, r in self._tasks.items()})

    @property
    def spec(self):
        """The ``tf.train.ClusterSpec`` of the running tasks."""
        import tensorflow as tf

        return tf.train.ClusterSpec(self.spec_dict)

    def connect(self, timeout: float = 60.0) -> Cluster:
        """Make this kernel a TensorFlow client of the cluster (idempotent); return the cluster.

        After it, ops and variables can be placed on any task with ``cluster.device("worker:1")``.
        One kernel talks to one cluster at a time (TensorFlow keeps one connection per process).
        """
        from .process import connection

        connection.connect(self, timeout)
        return self

    def device(self, task: str | TaskId, device_type: str = "CPU", index: int = 0):
        """A ``tf.device`` scope on ``task`` (``"worker:1"``, ``"ps:0"``): ops and variables made in it live there.

        Connects the kernel first if needed. ``device_type="GPU"`` and ``index`` pick a GPU of that task.
        """
        import tensorflow as tf

        record = self.task(task)
        device_type = device_type.upper()
        if device_type not in ("CPU", "GPU"):
            raise ConfigurationError(f"device_type={device_type!r}: use 'CPU' or 'GPU'.")
        name = f"{record.task.device}/device:{device_type}:{index}"
        if record.devices and name not in record.devices:
            raise ConfigurationError(
                f"{record.name} has no device {device_type}:{index}: its devices are "
                f"{', '.join(d.rsplit('/device:', 1)[-1] for d in record.devices)}.")
        self.job_queue.require_idle(f"place work on {record.name}")
        self.connect()
        return tf.device(name)

    def clock_offsets(self, max_age: float = 300.0) -> dict[str, float]:
        """Seconds each task's host clock is ahead of this kernel's (measured, kept ``max_age`` s)."""
        self._require_running("measure the tasks' clocks")
        now = time.monotonic()
        if self._clock_offsets is None or now - self._clock_offsets[0] > max_age:
            by_engine = measure_offsets(self._pool.client, [r.engine_id for r in self.tasks])
            self._clock_offsets = (now, {r.name: by_engine.get(r.engine_id, 0.0) for r in self.tasks})
        return dict(self._clock_offsets[1])

    def profile(self, seconds: float = 2.0, logdir: str | None = None):
        """An op-level trace of every task at once, for ``seconds`` (0-60), with TensorFlow's profiler.

        Returns a ``Profile``: ``events`` (ops per device and thread of each task, on this kernel's
        clock), ``transfers`` (Send/Recv pairs between tasks, linked), ``summary()``,
        ``save_chrome_trace(path)`` (Perfetto, chrome://tracing); displayed, it draws the timeline.
        Tracing slows the traced steps while it runs (see bench/dashboard.py); outside it, nothing.
        The raw traces go to ``logdir`` (TensorBoard's profile plugin reads it); by default a directory
        under the cluster's own temporary one, removed when the cluster stops.
        """
        from ..telemetry.profiler import capture

        self.last_profile = capture(self, seconds, logdir)  # the served /profile page shows the newest
        return self.last_profile

    @property
    def client(self):
        """The ipyparallel ``Client`` of the engine pool."""
        self._require_running("use the engine pool")
        return self._pool.client

    def status(self) -> ClusterStatus:
        """A table of the tasks: text in a terminal, HTML in a notebook.

        States follow the engines as it happens (``silent``: not answering for 3 s; ``lost``: gone;
        ``recovering``: being re-hosted); this also asks the controller, for borrowed engines.
        """
        if self._state == "running" and self._pool is not None:
            alive = set(self._pool.client.ids)
            for record in self.tasks:
                gone = record.engine_id not in alive or (self._is_local(record) and not psutil.pid_exists(record.pid))
                if gone and record.state in (RUNNING, SILENT):
                    self.health.set_state(record, LOST, "its engine left the controller")
        active = [self.job_queue.current] + self.job_queue.queued
        return ClusterStatus(self.name, self._state, self._launcher, self.tasks, self.network,
                             tuple(job.describe() for job in active if job is not None), self.log_path)

    def _publish_tasks(self) -> None:
        """Task states changed: the registry (read by the panel and by attached processes) says so at once."""
        if self._state == "running":
            self._write_registry()

    def _controller_lost(self, reason: str) -> None:
        """The controller exited (in the health monitor's thread): fail jobs at once, then stop everything."""
        self.failure = (f"{reason}, so cluster {self.name!r} cannot be controlled any more: it was stopped, with its "
                        "engines. Start a new wb.Cluster(...); jobs resume from their last checkpoint with resume=True.")
        self.health.controller_lost(self.failure)
        notice(self.failure, TaskFaultWarning, f"cluster {self.name}")
        threading.Thread(target=self._fail, name=f"workbench-stop-{self.name}", daemon=True).start()

    def _fail(self) -> None:
        with self._lifecycle:
            if self._state in ("running", "starting"):
                self._teardown(30.0)
                self._state = "failed"

    def _write_registry(self) -> None:
        if self.attached:  # the owner's record stays the owner's
            return
        proc = psutil.Process()
        registry.write_record(ClusterRecord(
            name=self.name,
            state=self._state,
            engines=self._launcher,
            owned=bool(self._pool and self._pool.owned),
            client_pid=proc.pid,
            client_created=proc.create_time(),
            cluster_file=self._pool.cluster_file if self._pool else "",
            profile_dir=self._pool.profile_dir if self._pool else "",
            spec=self.spec_dict,
            tasks=self.tasks,
            gpus_per_worker=self._gpus_per_worker,
            endpoints=dict(self._endpoints),
            network=self.network,
            updated=time.time(),
            workbench_version=workbench_version(),
        ))

    def __repr__(self) -> str:
        return f"<workbench.Cluster {self.name!r} {self._state}: {self._ps} ps, {self._workers} worker(s), engines={self._launcher!r}>"

    def _repr_html_(self) -> str:
        return self.status()._repr_html_()
