"""Giving engines their TensorFlow tasks, and giving a task a new engine when its own was lost.

``TaskHosting`` (held by the cluster as ``cluster.hosting``) talks to the engines about their tasks:
brings the pool up (``bring_up``) and down (``tear_down``), adds and drops workers (``scale``), probes
engines, imports TensorFlow with the right GPUs, starts one server per task, checks what they listen
on, and re-hosts a task on a fresh engine (``replace_task``) after a crash, a hang or a kill.
"""

from __future__ import annotations

import os
import signal
import time
import warnings
from typing import Any

import psutil

from .._version import install_command
from ..errors import (
    ClusterStartError,
    ClusterStateError,
    ConfigurationError,
    EngineForkWarning,
    ExposedPortsWarning,
    LauncherOptionsWarning,
    LowMemoryWarning,
    ServerStartError,
    TensorFlowImportError,
    VersionMismatchError,
    WorkbenchError,
)
from ..progress import ProgressSink, make_progress
from .health import ENGINE_EXITED, LOST, RECOVERING, RUNNING, SILENT, STOPPED
from .launch import engine_side
from .launch.calls import Deadline, RemoteCallFailed, RemoteCallsTimedOut, run_on_engines
from .launch.launchers import LOCAL_LAUNCHERS
from .launch.pool import local_hostnames
from .machine.gpus import assign_gpus, discover_gpus
from .machine.memory import available_memory, engine_memory_warning
from .machine.versions import workbench_version
from .process import connection
from .process.containment import describe, exposed
from .registry import registry_path
from .spec import TaskId
from .status import TaskRecord

KILL_WAIT_SECONDS = 15.0  # how long re-hosting waits for a hung engine it killed to be gone


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class TaskHosting:
    """The engine side of a ``wb.Cluster``'s tasks: held by the cluster as ``cluster.hosting``.

    It reads and writes the cluster's task records, engine pool and health; the cluster's public
    ``scale``, ``replace_task``, ``check_exposure`` and ``settle`` are its methods.
    """

    def __init__(self, cluster):
        self.cluster = cluster

    def _run_each(self, calls: dict[int, tuple], phase: str, deadline: Deadline, progress: ProgressSink) -> dict[int, Any]:
        """Run ``{engine_id: (function, *args)}`` on the engines in parallel; results by engine id."""
        try:
            return run_on_engines(self.cluster.pool.client, calls, deadline,
                                  lambda done, total: progress.update(phase, done, total))
        except RemoteCallFailed as exc:
            raise ClusterStartError(f"engine {exc.engine} failed while {phase}: {exc.reason}") from None
        except RemoteCallsTimedOut as exc:
            raise ClusterStartError(
                f"timed out after {deadline.seconds:.0f} s while {phase}: engine(s) {exc.pending} did not answer. "
                "Pass a larger start_timeout if they are merely slow."
            ) from None

    def assign_tasks(self, assignment: dict[TaskId, int], deadline: Deadline, progress: ProgressSink,
                      previous: dict[TaskId, TaskRecord] | None = None) -> None:
        """Give each engine of ``assignment`` its task: probe, import TensorFlow, start the server.

        ``previous`` holds the records of tasks being re-hosted: such a task keeps its address when
        its new engine is on the same host (and the port is free again).
        """
        previous = previous or {}
        by_engine = {eid: task for task, eid in assignment.items()}
        controller_ip, lifeline = self.cluster.pool.controller_ip, self.cluster.pool.lifeline
        probes = self._run_each({e: (engine_side.probe, controller_ip, lifeline) for e in by_engine}, "probing engines",
                                deadline, progress)
        for eid, task in by_engine.items():
            info = probes[eid]
            if info["workbench_version"] != workbench_version():
                raise VersionMismatchError(
                    f"engine {eid} ({info['host']}, pid {info['pid']}) runs workbench {info['workbench_version']} "
                    f"but the client runs {workbench_version()}: install the same version in both environments."
                )
            self.cluster.records[task] = TaskRecord(task.job, task.index, eid, info["host"], pid=info["pid"])
            if self.is_local(self.cluster.records[task]):
                self.cluster.pool.watch([info["pid"]])

        visible = self._plan_gpus(assignment, probes)
        serving: dict[TaskId, int | None] = {}  # the port each server listens on, where the spec names another
        namespaces: dict[TaskId, dict | None] = {}  # the network namespace each server joins (backend netns)
        imports = self._run_each(
            {eid: (engine_side.prepare_tensorflow, visible[task]) for task, eid in assignment.items()},
            "TensorFlow imported", deadline, progress,
        )
        for task, eid in assignment.items():
            self._check_import(eid, probes[eid], imports[eid])
            record = self.cluster.records[task]
            record.tensorflow = imports[eid]["version"]
            record.address = _format_address(probes[eid]["address"], imports[eid]["port"])
            serving[task], namespaces[task] = None, None
            if self.cluster.links.emulator is not None:  # named in the spec: the task's end of its emulated link
                record.address, serving[task], namespaces[task] = self.cluster.links.address_for(str(task), record.address)
            old = previous.get(task)
            if old is not None and old.address.rpartition(":")[0] == record.address.rpartition(":")[0]:
                record.address = old.address  # the same host: the same address, if its port is free again
        spec = self.cluster.spec_dict
        servers = self._run_each(
            {eid: (engine_side.start_server, spec, task.job, task.index, serving[task], namespaces[task],
                   self._sharing(task))
             for task, eid in assignment.items()},
            "TF servers up", deadline, progress,
        )
        for task, eid in assignment.items():
            result = servers[eid]
            if not result["ok"]:
                raise ServerStartError(f"the TF server for {task} on engine {eid} did not start: {result['error']}")
            record = self.cluster.records[task]
            record.address = result["address"]
            record.devices = result["devices"]
            record.gpus = [g for g in (result["cuda_visible_devices"] or "").split(",") if g]
            record.state, record.since = RUNNING, time.time()
            if serving[task] is not None and result["serving"] != serving[task]:  # the server took another port
                self.cluster.links.relink(str(task), _format_address(probes[eid]["address"], result["serving"]))
        self.cluster.links.follow_tasks()

    def _sharing(self, task: TaskId) -> int:
        """How many tasks share the cores of ``task``'s machine as ``machine.threads`` counts them: a worker, the
        workers there (they compute at once; a ps's updates are small); a ps, every task there."""
        host = self.cluster.records[task].host
        return sum(1 for other in self.cluster.records.values()
                   if other.host == host and (task.job != "worker" or other.job == "worker"))

    def check_exposure(self, records: list[TaskRecord] | None = None, deadline: Deadline | None = None,
                       stacklevel: int = 2) -> list[str]:
        """Warn (``ExposedPortsWarning``) if a task listens on every interface; return those ``task address`` lines.

        Asked of the engines themselves, so it holds for engines on other hosts too. A task whose
        bind address the user set to ``"*"`` chose that and is not reported.
        """
        records = self.cluster.tasks if records is None else records
        deadline = deadline or Deadline(30)
        found = self._run_each({r.engine_id: (engine_side.listening,) for r in records}, "checking ports", deadline,
                               make_progress(False))
        open_ports, reasons = [], set()
        for record in records:
            state = found[record.engine_id]
            wide = [f"{record.name} {describe(a)}" for a in exposed([tuple(a) for a in state["listeners"]])]
            if wide and not state["chosen"]:
                open_ports += wide
                reasons.add(state["why"] or "they bound every interface")
        if open_ports:
            warnings.warn(
                f"cluster {self.cluster.name!r}: TensorFlow ports listen on every network interface with no authentication: "
                f"{', '.join(open_ports)}. Anyone who can reach these hosts can run code in those processes. Why, and "
                f"what to do: {'; '.join(sorted(reasons))}. Until then, keep these ports behind a firewall.",
                ExposedPortsWarning, stacklevel=stacklevel)
        return open_ports

    def _plan_gpus(self, assignment: dict[TaskId, int], probes: dict[int, dict]) -> dict[TaskId, list[str]]:
        if not self.cluster.gpus_per_worker:
            return {task: [] for task in assignment}
        tasks_by_host: dict[str, list[TaskId]] = {}
        available: dict[str, list[str]] = {}
        for task, eid in assignment.items():
            host = probes[eid]["host"]
            tasks_by_host.setdefault(host, []).append(task)
            available.setdefault(host, probes[eid]["gpus"])
        in_use: dict[str, list[str]] = {}
        for record in self.cluster.records.values():
            if record.task not in assignment:
                in_use.setdefault(record.host, []).extend(record.gpus)
        return assign_gpus(tasks_by_host, available, self.cluster.gpus_per_worker, in_use)

    def _check_import(self, eid: int, probe: dict, result: dict) -> None:
        where = f"engine {eid} ({probe['host']}, pid {probe['pid']}, Python {probe['python']})"
        if not result["ok"]:
            raise TensorFlowImportError(
                f"{where} could not import TensorFlow: {result['error']}. Install it in the engines' "
                f"environment (`{install_command('cpu')}`, or `{install_command('gpu')}`), or point the launcher at a Python "
                "that has it."
            )
        if result["version"] != self.cluster.client_tf_version:
            raise VersionMismatchError(
                f"{where} runs TensorFlow {result['version']} but this client runs {self.cluster.client_tf_version}: "
                "install the same TensorFlow version in the client and engine environments."
            )

    @staticmethod
    def is_local(record: TaskRecord) -> bool:
        """Whether ``record``'s engine runs on this machine (its pid is then a process here)."""
        return record.host in local_hostnames()

    # -- engines added and removed -------------------------------------------------------------

    def bring_up(self, layout: list[TaskId], deadline: Deadline, progress: ProgressSink) -> None:
        """``Cluster.start``'s work: the pool, an engine per task of ``layout``, the links, the tasks on their engines."""
        cluster = self.cluster
        self.warn_if_memory_short(len(layout), stacklevel=4)  # user -> start -> bring_up -> warn
        cluster.pool = cluster.pool_factory()
        cluster.pool.start(deadline)
        cluster.pool.remove_on_death(str(registry_path(cluster.name)))
        ids = cluster.pool.add_engines(len(layout), deadline,
                                        lambda done, total: progress.update("engines registered", done, total))
        self.warn_of_new_notices(("", 0), stacklevel=4)
        cluster.links.open()
        self.assign_tasks(dict(zip(layout, ids)), deadline, progress)
        self.check_exposure(cluster.tasks, deadline, stacklevel=4)

    def tear_down(self, timeout: float) -> None:
        """The engines go (borrowed ones are released, left running), then the links; every task is ``stopped``."""
        cluster = self.cluster
        pool, cluster.pool = cluster.pool, None
        if cluster.attached:  # only this process's connection ends: the tasks are the owner's
            if pool is not None:
                pool.close(timeout)
            return
        if pool is not None:
            if not pool.owned and cluster.records:
                try:
                    pool.remove_engines([r.engine_id for r in cluster.records.values()], [], Deadline(min(timeout, 15)))
                except Exception:  # noqa: BLE001 - borrowed engines may already be gone
                    pass
            pool.close(timeout)
        # after the engines: a task's connections to this kernel must close while its link still carries the
        # close (a namespace removed first leaves the kernel's TensorFlow waiting on peers that never answer)
        cluster.links.close()
        for record in cluster.records.values():
            record.state = STOPPED

    def find_lost_engines(self) -> None:
        """Mark ``lost`` the running tasks whose engine left the controller (or, local, whose process is gone)."""
        alive = set(self.cluster.pool.client.ids)
        for record in self.cluster.tasks:
            gone = record.engine_id not in alive or (self.is_local(record) and self.cluster.pool.process(record.pid) is None)
            if gone:
                self.cluster.health.set_state(record, LOST, "its engine left the controller", only_from=(RUNNING, SILENT))

    def check_local_gpus(self, workers: int) -> None:
        """Refuse ``workers`` local workers that this machine has too few GPUs for (``gpus_per_worker`` each)."""
        per_worker = self.cluster.gpus_per_worker
        if not per_worker:
            return
        available = discover_gpus({**os.environ, **self.cluster.env})
        needed = workers * per_worker
        if needed > len(available):
            raise ConfigurationError(
                f"{workers} worker(s) x gpus_per_worker={per_worker} need {needed} GPU(s), but this "
                f"machine has {f'{len(available)} {available}' if available else 'none'}: lower gpus_per_worker or workers, or use "
                "gpus_per_worker=0 to train on CPUs."
            )

    def warn_if_memory_short(self, engines: int, stacklevel: int = 3) -> None:
        """Warn, pointing at the user's call (``stacklevel`` for ``warnings.warn``), when local engines may not fit in memory."""
        cluster, pool = self.cluster, self.cluster.pool
        if cluster.launcher in LOCAL_LAUNCHERS:  # engines elsewhere use their nodes' memory
            from .launch.fork_launcher import kept_warm

            forked = cluster.forks and not (pool is not None and pool.fork_notice)
            # start(): the warm process is yet to come, unless a stopped cluster kept one (in memory already)
            first = pool is None and kept_warm.pid is None
            message = engine_memory_warning(engines, *available_memory(), forked=forked, with_warm=forked and first)
            if message:
                warnings.warn(f"cluster {cluster.name!r}: {message}", LowMemoryWarning, stacklevel=stacklevel)

    def notices(self) -> tuple[str, int]:
        """What the pool said so far: its fork notice and how many launcher notices (``warn_of_new_notices`` takes it)."""
        pool = self.cluster.pool
        return getattr(pool, "fork_notice", ""), len(getattr(pool, "launcher_notices", []))

    def warn_of_new_notices(self, known: tuple[str, int], stacklevel: int = 3) -> None:
        """Warn of what the pool said since ``known``: engines started as new processes instead of forks, options
        the workbench added to the launcher's command (one warning each)."""
        pool, name = self.cluster.pool, self.cluster.name
        notice = getattr(pool, "fork_notice", "")
        if notice and notice != known[0]:
            warnings.warn(f"cluster {name!r}: engines start as separate processes, each importing TensorFlow "
                          f"(more memory, slower start), because {notice}", EngineForkWarning, stacklevel=stacklevel)
        for added in getattr(pool, "launcher_notices", [])[known[1]:]:
            warnings.warn(f"cluster {name!r}: {added}", LauncherOptionsWarning, stacklevel=stacklevel)

    def scale_workers(self, workers: int, deadline: Deadline) -> None:
        """``Cluster.scale``'s work: start or stop worker tasks. A job that runs follows at its next step boundary
        (``job.rescale``: it takes new workers, and lets leaving ones go before their engines stop); without one,
        this kernel's TensorFlow connection grows or shrinks in place (what it made on the tasks stays valid)."""
        cluster = self.cluster
        job, now = cluster.job_queue.current, cluster.worker_count
        if job is not None and workers != now:
            job.check_rescale(workers)  # refuses what it cannot follow, before anything starts or stops
        if workers > now:  # user -> scale -> _scale -> scale_workers -> add_workers: warnings point at the user's line
            self.add_workers([TaskId("worker", i) for i in range(now, workers)], deadline, stacklevel=5)
            cluster.worker_count = workers
            if job is not None:
                job.rescale()
            else:
                connection.resize(cluster, timeout=deadline.remaining(5))
        elif workers < now:
            leaving = [TaskId("worker", i) for i in range(workers, now)]
            names = tuple(str(t) for t in leaving)
            if job is not None:
                job.rescale(leaving=names)  # returns once the job no longer uses them
            # out of the cluster's tasks first, so that a re-hosting's connection update from now on leaves them out;
            # then out of this kernel's connection (done already if the job followed; not if it ended first) before
            # their engines stop: a task that leaves later makes TensorFlow log "Task 2 was not defined in sparse job"
            records = self.forget_tasks(leaving)
            try:
                connection.resize(cluster, names, timeout=deadline.remaining(5))
            finally:
                self.stop_engines(records, deadline)
                cluster.worker_count = workers

    def add_workers(self, new_tasks: list[TaskId], deadline: Deadline, stacklevel: int = 3) -> None:
        """Start an engine for each of ``new_tasks`` and give it its task; if that fails, none of them stays."""
        cluster = self.cluster
        if cluster.launcher in LOCAL_LAUNCHERS:
            self.check_local_gpus(cluster.worker_count + len(new_tasks))
        self.warn_if_memory_short(len(new_tasks), stacklevel=stacklevel + 1)
        progress = make_progress(cluster.progress)
        try:
            known = self.notices()
            ids = self.add_engines(len(new_tasks), deadline, progress)
            self.warn_of_new_notices(known, stacklevel=stacklevel + 1)
            self.assign_tasks(dict(zip(new_tasks, ids)), deadline, progress)
            self.check_exposure([cluster.records[t] for t in new_tasks], deadline, stacklevel=stacklevel + 1)
        except BaseException:
            progress.close("scaling failed", ok=False)
            self.drop_tasks([t for t in new_tasks if t in cluster.records], deadline)
            raise
        progress.close(f"cluster {cluster.name!r} now has {cluster.worker_count + len(new_tasks)} worker task(s)")

    def add_engines(self, n: int, deadline: Deadline, progress: ProgressSink) -> list[int]:
        """``n`` more engines from the pool (borrowed pools: ones no task uses); their ids."""
        def report(done: int, total: int) -> None:
            progress.update("engines registered", done, total)

        pool = self.cluster.pool
        if not pool.owned:
            used = [r.engine_id for r in self.cluster.records.values()]
            return pool.add_engines(n, deadline, report, exclude=used)
        return pool.add_engines(n, deadline, report, in_use=self._tasks_per_host())

    def _tasks_per_host(self) -> dict[str, int]:
        """Running tasks per host, counted under its name and under its address (a lost task no longer counts)."""
        counts: dict[str, int] = {}
        for record in self.cluster.records.values():
            if record.state in (LOST, RECOVERING, STOPPED):
                continue
            for key in {record.host, record.address.rpartition(":")[0].strip("[]")} - {""}:
                counts[key] = counts.get(key, 0) + 1
        return counts

    def drop_tasks(self, tasks: list[TaskId], deadline: Deadline) -> None:
        """Forget ``tasks`` and stop their engines."""
        self.stop_engines(self.forget_tasks(tasks), deadline)

    def forget_tasks(self, tasks: list[TaskId]) -> list[TaskRecord]:
        """Take ``tasks`` out of the cluster (its spec, status and connection updates); their records."""
        return [self.cluster.records.pop(t) for t in tasks]

    def stop_engines(self, records: list[TaskRecord], deadline: Deadline) -> None:
        self.cluster.pool.remove_engines([r.engine_id for r in records], [r.pid for r in records if self.is_local(r)],
                                          deadline)

    # -- re-hosting --------------------------------------------------------------------------

    def settle(self, timeout: float) -> bool:
        """Wait until no start, scale or re-hosting is under way (each holds the cluster's lifecycle lock until its
        tasks serve and this kernel's connection knows them); False if one still runs after ``timeout`` s."""
        if not self.cluster.lifecycle.acquire(timeout=timeout):
            return False
        self.cluster.lifecycle.release()
        return True

    def replace_task(self, task: str | TaskId, timeout: float | None = None, refresh_connection: bool = True) -> TaskRecord:
        """Host ``task`` (``"worker:1"``, ``"ps:0"``) on a new engine, after its own was lost or hung.

        A hung engine (``silent`` in ``status()``) is killed first. The new engine keeps the task's
        address when it runs on the same host (local engines are forked from the warm process: about
        a second in all), and this kernel's TensorFlow connection is updated, so what lives on the
        other tasks stays usable. What lived on the replaced task is gone: a ps's variables, a
        worker's datasets. ``wb.train`` does this by itself when a task of a running job is lost
        (and restores a ps's variables from the newest checkpoint). The task's state goes
        ``recovering`` then ``running``; returns its new record. ``refresh_connection=False`` leaves the
        update of this kernel's connection to its next use (for callers that do not use it: all-reduce).
        """
        with self.cluster.lifecycle:
            self.cluster.require_running("re-host a task")
            if self.cluster.attached:
                raise ClusterStateError(f"cluster {self.cluster.name!r} is attached: process {self.cluster.owner_pid} owns it and "
                                        "re-hosts its tasks.")
            old = self.cluster.task(task)
            gone = old.state == LOST and old.note == ENGINE_EXITED  # its lifeline closed: the process is gone
            deadline = Deadline(self.cluster.start_timeout if timeout is None else timeout)
            self.cluster.health.set_state(old, RECOVERING, "starting a new engine")
            added: list[int] = []
            try:
                if not gone or self.is_local(old):
                    self._kill_engine(old, deadline)
                added = self.add_engines(1, deadline, make_progress(False))
                self.assign_tasks({old.task: added[0]}, deadline, make_progress(False), previous={old.task: old})
                new = self.cluster.records[old.task]
                self.check_exposure([new], deadline, stacklevel=4)  # through Cluster.replace_task
                if refresh_connection:
                    connection.refresh(self.cluster, new.name, deadline.remaining(5))
                else:  # the caller does not use it: the next connect() updates it
                    connection.defer_refresh(self.cluster, new.name)
            except BaseException as exc:
                self._undo_replacement(old, added)
                why = str(exc) if isinstance(exc, WorkbenchError) else f"{type(exc).__name__}: {exc}"
                self.cluster.health.set_state(old, LOST, f"re-hosting failed: {why}")
                if not isinstance(exc, Exception):
                    raise
                raise ClusterStateError(f"re-hosting {old.name} of cluster {self.cluster.name!r} failed: {why}") from None
            new.restarts = old.restarts + 1
            self.cluster.health.set_state(new, RUNNING, f"re-hosted on engine {new.engine_id}")
            return new

    def _kill_engine(self, record: TaskRecord, deadline: Deadline) -> None:
        """Make sure the engine of ``record`` is gone (SIGKILL: a hung engine handles no gentler request)."""
        if self.is_local(record):
            try:
                if (proc := self.cluster.pool.process(record.pid)) is not None:  # None: gone already
                    proc.kill()
            except psutil.Error:
                pass  # gone meanwhile
        elif record.engine_id in self.cluster.pool.client.ids:
            self.cluster.pool.client.send_signal(signal.SIGKILL, targets=[record.engine_id], block=False)  # through its nanny
        wait = Deadline(min(KILL_WAIT_SECONDS, deadline.remaining(1)))
        while self._engine_alive(record) and not wait.expired:
            time.sleep(0.02)
        if self._engine_alive(record):
            raise ClusterStateError(f"the engine of {record.name} (engine {record.engine_id}, pid {record.pid} on "
                                    f"{record.host}) was still there {wait.seconds:.0f} s after SIGKILL")

    def _engine_alive(self, record: TaskRecord) -> bool:
        """The process itself for a local engine; the controller's view for one elsewhere."""
        if not self.is_local(record):
            return record.engine_id in self.cluster.pool.client.ids
        try:
            proc = self.cluster.pool.process(record.pid)
            return proc is not None and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def _undo_replacement(self, old: TaskRecord, added: list[int]) -> None:
        """A re-hosting that failed: stop the engine it started, and keep the old record."""
        new = self.cluster.records.get(old.task)
        self.cluster.records[old.task] = old
        if added:
            pids = [new.pid] if new is not None and new is not old and self.is_local(new) else []
            try:
                self.cluster.pool.remove_engines(added, pids, Deadline(15))
            except Exception:  # noqa: BLE001 - best effort; the engine holds a lifeline and goes with the cluster
                pass
