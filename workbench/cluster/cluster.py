"""``wb.Cluster``: an ipyparallel engine pool whose engines host TensorFlow ``ps`` and ``worker`` tasks."""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from ..errors import (
    ClusterStartError,
    ClusterStateError,
    ConfigurationError,
    ControllerLost,
    TaskFaultWarning,
    UnknownTaskError,
    WorkbenchError,
)
from ..native_logs import notice
from ..progress import ProgressSink, make_progress
from ..telemetry.clocks import measure_offsets
from ..telemetry.log import EventLog
from . import sharing
from .health import TaskHealth
from .hosting import TaskHosting
from .jobs import JobList, JobQueue
from .launch.borrowed import AttachedPool
from .launch.calls import Deadline
from .launch.launchers import LOCAL_LAUNCHERS
from .launch.pool import OwnedPool, owned_pool_factory
from .links import ClusterLinks
from .machine.gpus import validate_gpus_per_worker
from .machine.versions import client_tensorflow_version
from .registry import Endpoint
from .sharing import Shared
from .spec import TaskId, cluster_spec_dict, role_layout, validate_counts, validate_name, validate_timeout
from .status import ClusterStatus, TaskRecord

# Strong references: a running cluster stays reachable (for running_clusters(), the magics and the
# stop at exit) until it is stopped, even if the code that started it dropped its variable.
_LIVE_CLUSTERS: set = set()


def doc_from(owner: Callable) -> Callable[[Callable], Callable]:
    """A ``Cluster`` method that hands its work to a helper (``cluster.links``, ...) shows the helper's docstring,
    written once, where the code is."""
    def decorate(method: Callable) -> Callable:
        method.__doc__ = owner.__doc__
        return method

    return decorate


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


class Cluster:
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
        Seconds allowed for ``start()`` (and each ``scale()``) as a whole; the controller's hub gets 10 s or more to answer.
    env:
        Extra environment variables for the engines.
    progress:
        ``True``: a bar in a notebook, text in a terminal; ``False``: quiet; or a ``ProgressSink``.
    network:
        Emulated links between the tasks, which ``shape()`` sets while they run: ``"auto"`` (unshaped
        until then), a rate for every link from the start (``"1gbit"``), or
        ``dict(rate=, delay=, between=, backend=, mtu=)``. Backends: ``"netns"`` (a network namespace per
        task, ``tc`` on its veth; root, Linux; delay only where the kernel has netem; ``mtu=9000`` for
        jumbo frames, 1500 by default), ``"user"`` (a relay process; no root), ``"auto"`` (netns where it
        can run, else user); ``status()`` names the one in use. Local engines only. Default: none (tasks
        talk directly, as without the workbench).
    """

    # Called with every cluster this process starts, once its tasks run (a failure stops the cluster).
    # Higher layers add theirs here (``workbench.control`` adds the owner's control endpoint), so the
    # engine pool knows nothing of what they are; they keep what must close with it (``keep``).
    start_hooks: ClassVar[list[Callable[[Cluster], None]]] = []

    def __init__(self, ps: int = 1, workers: int = 2, *, engines: str = "local", gpus_per_worker: int = 0,
                 name: str | None = None, controller_ip: str | None = None, start_timeout: float = 300.0,
                 env: Mapping[str, str] | None = None, progress: bool | ProgressSink = True, network: Any = None,
                 **launcher_options: Any):
        validate_counts(ps, workers)
        self.gpus_per_worker = validate_gpus_per_worker(gpus_per_worker)  # the settings it was made with, as given
        self.name = validate_name(name)
        self.start_timeout = validate_timeout(start_timeout)
        self.progress = progress
        self.ps_count, self.worker_count = ps, workers
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.records: dict[TaskId, TaskRecord] = {}  # each task's record (``tasks`` lists them in order)
        self._state = "new"
        self._started_at = 0.0
        self.pool: OwnedPool | AttachedPool | None = None  # the engine pool (ipyparallel's cluster, client, reaper)
        self.pool_factory: Callable[[], OwnedPool | AttachedPool]  # makes ``pool`` at start()
        self.telemetry = EventLog()  # step spans and progress of every job on this cluster (wb.dashboard)
        self.lifecycle = threading.RLock()  # start/scale/stop, from the kernel or the control thread
        self.shared = Shared(self)  # what higher layers keep with it, and its registry record
        # this process's training jobs on the cluster, one running at a time; the record names the one running
        self.job_queue = JobQueue(self.name, on_change=self.shared.write_record)
        self.last_profile = None  # the newest cluster.profile(), for the served /profile page
        self._clock_offsets: tuple[float, dict[str, float]] | None = None
        self.owner_pid = 0  # set by attach(): the process that runs this cluster
        self.forks = False  # local engines are forked from a warm process (unless that is refused)
        # the tasks' health, followed as it changes (owned pools: the reaper's reports); jobs subscribe to it
        self.health = TaskHealth(self.name, lambda: self.tasks, self._publish_tasks, self.telemetry)
        self.failure = ""  # why the cluster failed while running (its controller exited), if it did
        self.hosting = TaskHosting(self)  # the engines' side of the tasks: start, scale, re-host
        if engines is None:  # set by from_existing or attach
            self.links = ClusterLinks(self, None, False)
            return
        engine_env = lambda: {"TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1"), **self.env}  # noqa: E731
        self.pool_factory, self.forks = owned_pool_factory(self.name, engines, controller_ip, engine_env,
                                                             self.gpus_per_worker == 0, launcher_options)
        local = engines in LOCAL_LAUNCHERS
        if local:
            self.hosting.check_local_gpus(workers)
        self.links = ClusterLinks(self, network, local)  # the emulated links between tasks: cluster.shape(...)
        self.launcher = engines

    # -- construction helpers -------------------------------------------------------------

    @classmethod
    @doc_from(sharing.borrow)
    def from_existing(cls, source: Any = None, *, ps: int = 1, workers: int = 2, profile: str | None = None,
                      cluster_id: str | None = None, name: str | None = None, start_timeout: float = 120.0,
                      progress: bool | ProgressSink = True) -> Cluster:
        return sharing.borrow(cls, source, ps, workers, profile, cluster_id, name=name, start_timeout=start_timeout,
                              progress=progress)

    @classmethod
    @doc_from(sharing.attach)
    def attach(cls, name: str, *, timeout: float = 60.0) -> Cluster:
        cluster = sharing.attach(cls, name, timeout)
        _LIVE_CLUSTERS.add(cluster)
        return cluster

    @property
    def attached(self) -> bool:
        """True for a cluster from ``attach()``: another process owns it."""
        return bool(self.owner_pid)

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
        sharing.refuse_a_running_name(self.name)
        progress = make_progress(self.progress)
        deadline = Deadline(self.start_timeout)
        self._state = "starting"
        self.shared.write_record()  # the panel shows it starting; a failed start removes it with the rest
        self.client_tf_version = client_tensorflow_version()
        try:
            self.hosting.bring_up(role_layout(self.ps_count, self.worker_count), deadline, progress)
            self._state = "running"
            self.health.follow(self.pool.health_reports(), self.pool.controller_pids, self._controller_lost)
            for hook in self.start_hooks:
                hook(self)
        except BaseException as exc:
            progress.close(f"cluster {self.name!r} failed to start", ok=False)
            self._teardown()
            self._state = "failed"
            if isinstance(exc, WorkbenchError) or not isinstance(exc, Exception):
                raise
            raise ClusterStartError(f"starting cluster {self.name!r} failed: {type(exc).__name__}: {exc}") from exc
        self.mark_running()
        from .process import connection

        connection.prepare_process()  # once per process, while the start's caller waits (not later, in a job's thread)
        _LIVE_CLUSTERS.add(self)
        self.shared.write_record()
        progress.close(
            f"cluster {self.name!r} ready: {self.ps_count} ps + {self.worker_count} worker task(s) "
            f"in {deadline.seconds - deadline.remaining():.1f} s"
        )
        return self

    def mark_running(self) -> None:
        """Its tasks serve (``start``; ``attach``: another process's cluster, running already)."""
        self._state = "running"
        self._started_at = time.monotonic()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop every task and everything this cluster started. Safe to call twice.

        Jobs go first: queued ones are cancelled and the running one stops after its calls in flight
        (each line of what was done is printed), so no job sees its tasks vanish under it.

        Local forked engines' warm process, which imported TensorFlow, is kept for this process's next
        cluster (its engines start without importing again); it forks nothing while kept, and exits after
        five minutes unless taken, or with this process.
        """
        with self.lifecycle:
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
        return getattr(self.pool, "scratch", "") or ""

    @property
    def jobs(self) -> JobList:
        """This process's training jobs on the cluster, oldest first, with their states (queued, running, stopping,
        finished, failed, cancelled); ``cluster.jobs["async-ps-3"]`` finds one by name. One runs at a time."""
        return self.job_queue.all()

    def _teardown(self, timeout: float = 60.0) -> None:
        self.health.closing = True  # the engines stopped from here on are not "lost"
        self.shared.close_all()
        self.hosting.tear_down(timeout)
        self.shared.remove_record()
        _LIVE_CLUSTERS.discard(self)

    def __enter__(self) -> Cluster:
        if self._state == "new":
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def scale(self, workers: int | None = None, ps: int | None = None) -> Cluster:
        """Add or remove worker tasks while running (the highest indices go first).

        The number of ps tasks is fixed while running: variables live on them. A job that trains follows at
        its next step boundary (async-ps and sync-ps; the other strategies refuse a scale while they train):
        a scale-up returns once the new engines serve, a scale-down once the job no longer uses the workers
        that leave. Two scales before the job's next boundary are one change in ``job.events``.
        """
        with self.lifecycle:
            return self._scale(workers, ps)

    def _scale(self, workers: int | None, ps: int | None) -> Cluster:
        self.require_running("scale")
        if self.attached:
            raise ClusterStateError(f"cluster {self.name!r} is attached: process {self.owner_pid} owns it. Scale it "
                                    "there, or from the Workbench panel.")
        if ps is not None and ps != self.ps_count:
            raise ConfigurationError(
                f"ps={ps}: the number of ps tasks cannot change while the cluster runs (model variables live on "
                f"them). Stop the cluster and start a new one with ps={ps}."
            )
        workers = self.worker_count if workers is None else workers
        validate_counts(self.ps_count, workers)
        self.hosting.scale_workers(workers, Deadline(self.start_timeout))
        self._clock_offsets = None  # new tasks: measure again
        self.shared.write_record()
        return self

    @doc_from(TaskHosting.replace_task)
    def replace_task(self, task: str | TaskId, timeout: float | None = None, refresh_connection: bool = True) -> TaskRecord:
        record = self.hosting.replace_task(task, timeout, refresh_connection)
        self._clock_offsets = None  # a new process, maybe on another host: measure again
        return record

    @doc_from(TaskHosting.check_exposure)
    def check_exposure(self, records: list[TaskRecord] | None = None, deadline: Deadline | None = None,
                       stacklevel: int = 2) -> list[str]:
        return self.hosting.check_exposure(records, deadline, stacklevel + 1)

    @doc_from(TaskHosting.settle)
    def settle(self, timeout: float) -> bool:
        return self.hosting.settle(timeout)

    # -- the emulated links (held by cluster.links) ------------------------------------------

    @doc_from(ClusterLinks.shape)
    def shape(self, rate: Any = None, delay: Any = None, between: str = "all") -> str:
        return self.links.shape(rate, delay, between)

    shaped = property(lambda self: self.links.shaped, doc=ClusterLinks.shaped.__doc__)
    network = property(lambda self: self.links.describe(), doc=ClusterLinks.describe.__doc__)

    @doc_from(ClusterLinks.stats)
    def link_stats(self) -> dict:
        return self.links.stats()

    # -- what higher layers attach ---------------------------------------------------------

    @doc_from(Shared.keep)
    def keep(self, key: str, resource: Any, close: Callable[[], None] | None = None) -> Any:
        return self.shared.keep(key, resource, close)

    @doc_from(Shared.kept)
    def kept(self, key: str, default: Any = None) -> Any:
        return self.shared.kept(key, default)

    @doc_from(Shared.release)
    def release(self, key: str, close: bool = False) -> Any:
        return self.shared.release(key, close)

    @doc_from(Shared.advertise)
    def advertise(self, name: str, endpoint: Endpoint | None) -> None:
        self.shared.advertise(name, endpoint)

    # -- what users read -------------------------------------------------------------------

    def require_running(self, what: str) -> None:
        """Raise ``ClusterStateError`` (``ControllerLost`` after a lost controller) saying it cannot ``what`` now."""
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
        records = dict(self.records)  # one copy (atomic): the health monitor reads while start/scale/re-host write
        return [records[t] for t in sorted(records)]

    def task(self, name: str | TaskId) -> TaskRecord:
        """The record of ``"worker:1"``; ``UnknownTaskError`` names the tasks that exist."""
        task = TaskId.parse(name)
        if task not in self.records:
            raise UnknownTaskError(
                f"cluster {self.name!r} has no task {task}: its tasks are {', '.join(r.name for r in self.tasks) or 'none'}."
            )
        return self.records[task]

    @property
    def spec_dict(self) -> dict[str, list[str]]:
        """``{"ps": [...], "worker": [...]}`` addresses."""
        return cluster_spec_dict({t: r.address for t, r in self.records.items()})

    @property
    def spec(self):
        """The ``tf.train.ClusterSpec`` of the running tasks."""
        import tensorflow as tf

        return tf.train.ClusterSpec(self.spec_dict)

    def connect(self, timeout: float = 60.0) -> Cluster:
        """Make this kernel a TensorFlow client of the cluster (idempotent); return the cluster.

        ``cluster.device("worker:1")`` then places ops and variables on a task. One cluster per kernel at a time
        (TensorFlow keeps one connection per process)."""
        from .process import connection

        connection.connect(self, timeout)
        return self

    def device(self, task: str | TaskId, device_type: str = "CPU", index: int = 0, timeout: float = 30.0):
        """A ``tf.device`` scope on ``task`` (``"worker:1"``, ``"ps:0"``): ops and variables made in it live there.

        Connects the kernel first if needed. ``device_type="GPU"`` and ``index`` pick a GPU of that task. The task
        must answer a tiny op within ``timeout`` s, else a ``ClusterStateError`` says so (rather than a frozen kernel).
        """
        from .process import placing

        return placing.device_scope(self, self.task(task), device_type, index, validate_timeout(timeout, "timeout"))

    def clock_offsets(self, max_age: float = 300.0) -> dict[str, float]:
        """Seconds each task's host clock is ahead of this kernel's (measured, kept ``max_age`` s)."""
        self.require_running("measure the tasks' clocks")
        now = time.monotonic()
        if self._clock_offsets is None or now - self._clock_offsets[0] > max_age:
            by_engine = measure_offsets(self.pool.client, [r.engine_id for r in self.tasks])
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
        self.require_running("use the engine pool")
        return self.pool.client

    def status(self) -> ClusterStatus:
        """A table of the tasks: text in a terminal, HTML in a notebook.

        States follow the engines as it happens (``silent``: not answering for 3 s; ``lost``: gone;
        ``recovering``: being re-hosted); this also asks the controller, for borrowed engines.
        """
        if self._state == "running" and self.pool is not None:
            self.hosting.find_lost_engines()
        active = [self.job_queue.current] + self.job_queue.queued
        return ClusterStatus(self.name, self._state, self.launcher, self.tasks, self.network,
                             tuple(job.describe() for job in active if job is not None), self.log_path)

    def _publish_tasks(self) -> None:
        """Task states changed: the registry (read by the panel and by attached processes) says so at once."""
        if self._state == "running":
            self.shared.write_record()

    def _controller_lost(self, reason: str) -> None:
        """The controller exited (in the health monitor's thread): fail jobs at once, then stop everything."""
        self.failure = (f"{reason}, so cluster {self.name!r} cannot be controlled any more: it was stopped, with its "
                        "engines. Start a new wb.Cluster(...); jobs resume from their last checkpoint with resume=True.")
        self.health.controller_lost(self.failure)
        notice(self.failure, TaskFaultWarning, "")  # it names the cluster
        threading.Thread(target=self._fail, name=f"workbench-stop-{self.name}", daemon=True).start()

    def _fail(self) -> None:
        with self.lifecycle:
            if self._state in ("running", "starting"):
                self._teardown(30.0)
                self._state = "failed"

    def __repr__(self) -> str:
        return (f"<workbench.Cluster {self.name!r} {self._state}: {self.ps_count} ps, {self.worker_count} worker(s), "
                f"engines={self.launcher!r}>")

    def _repr_html_(self) -> str:
        return self.status()._repr_html_()
