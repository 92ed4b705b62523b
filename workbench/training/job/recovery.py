"""What a training job does when one of its tasks fails: notice, decide, re-host, restore, report.

A job's ``Supervisor`` subscribes to its cluster's task health (``cluster.health``): engines that
exit are ``lost`` at once, engines that stop answering are ``silent``. The job's loops ask it each
tick what changed, and it does the slow part (re-hosting a task on a new engine, then rebuilding
what the job kept there) in a thread of its own, so that training goes on with the other workers
meanwhile. Every fault becomes a ``Fault`` in ``job.faults``, a ``TaskEvent`` on the dashboards'
timeline, and one ``TaskFaultWarning`` in the notebook.

Tasks whose loss the job cannot absorb in place (a ps: the variables lived there; an all-reduce
worker: the group must be formed again) end the current run with ``TaskLost``; the job then
re-hosts them and restores the newest checkpoint (``restore_after_loss``). ``classify`` tells such a loss
from a bug in the user's functions, for every error a remote call raises.
"""

from __future__ import annotations

import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ... import native_logs
from ...cluster.health import LOST, RECOVERING, SILENT
from ...cluster.process import connection
from ...errors import ClusterStateError, ParameterServerLost, TaskFaultWarning, TrainingError, first_line
from ...native_logs import notice
from ...telemetry.events import TaskEvent

# Errors that mean "a task went away", as opposed to a bug in the model or data functions.
_INFRASTRUCTURE_ERRORS = ("UnavailableError", "AbortedError", "CancelledError", "DeadlineExceededError", "InternalError")
PS_CONFIRM_SECONDS = 1.0  # how long a lost connection is re-checked for a ps that is going away
MAX_RESTORES = 10  # restores from a checkpoint one job may do before it gives up (a task that keeps dying)
MIN_STRAGGLER_SECONDS = 1.0  # a call shorter than this is never a straggler, whatever its peers do
STRAGGLER_SAMPLES = 8  # completed calls needed before calls are compared with their median


class TaskLost(Exception):
    """Tasks a run cannot go on without were lost; ``error`` is what a job with ``recovery=None`` raises."""

    def __init__(self, tasks: list[str], why: str, error: BaseException, label: str = ""):
        super().__init__(why)
        self.tasks, self.why, self.error = tasks, why, error
        self.label = label or ", ".join(tasks)  # the task(s) at fault, named in job.faults and messages


@dataclass
class Fault:
    """One fault of a job's task and what was done about it (``job.faults`` holds them as dicts)."""

    task: str
    kind: str  # lost | silent | straggler
    detected: float  # seconds since the epoch
    step: int  # steps done when it was detected
    detail: str = ""
    action: str = "waited"  # re-hosted | restored | dropped | waited | failed
    recovered: float | None = None  # when the task (or the job, after a restore) was back
    resumed_from: int | None = None  # restores: the step the job went on from
    redone: int = 0  # restores: steps run again (done after the checkpoint it resumed from)
    count: int = 1  # stragglers: how many of the task's calls straggled

    @property
    def seconds(self) -> float | None:
        return None if self.recovered is None else self.recovered - self.detected

    def as_dict(self) -> dict:
        return {**asdict(self), "seconds": self.seconds}


class CallTimes:
    """Seconds per step of recently completed calls, to tell a straggling call from a slow job."""

    def __init__(self, window: int = 64):
        self._per_step: deque[float] = deque(maxlen=window)

    def add(self, seconds: float, steps: int = 1) -> None:
        self._per_step.append(seconds / max(steps, 1))

    def limit(self, factor: float, steps: int = 1) -> float | None:
        """How long a call of ``steps`` steps may run before it straggles; None until enough calls completed."""
        if len(self._per_step) < STRAGGLER_SAMPLES:
            return None
        return max(MIN_STRAGGLER_SECONDS, factor * statistics.median(self._per_step) * steps)


def _drain(items: queue.SimpleQueue) -> list:
    """What the queue holds now, oldest first, without waiting."""
    found = []
    while True:
        try:
            found.append(items.get_nowait())
        except queue.Empty:
            return found


class Supervisor:
    """One job's fault handling: health events in, re-hosting in the background, faults out."""

    def __init__(self, job):
        self.job = job
        self.cluster = job.cluster
        self.options = job.options
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._back: queue.SimpleQueue = queue.SimpleQueue()  # (task, ok) once a re-hosting finished
        self._rehosting: dict[str, threading.Thread] = {}
        self._warned: set[tuple[str, str]] = set()
        self._open: dict[str, Fault] = {}  # task -> its fault not yet over
        self._unsubscribe = self.cluster.health.subscribe(self._events.put)
        self.closed = False  # the job ended: a re-hosting still under way rebuilds nothing for it

    def close(self) -> None:
        self.closed = True
        self._unsubscribe()

    # -- what changed ------------------------------------------------------------------------

    def events(self) -> list[TaskEvent]:
        """Health events since the last call (the job's own tasks, and the controller's loss)."""
        return _drain(self._events)

    def rehosted(self) -> list[tuple[str, bool]]:
        """Tasks whose re-hosting finished since the last call: ``(task, succeeded)``."""
        return _drain(self._back)

    def hung(self, names: list[str]) -> list[str]:
        """Those of ``names`` that answered nothing for ``hang_timeout`` seconds or more."""
        now = time.time()
        records = {r.name: r for r in self.cluster.tasks}
        return [n for n in names if n in records and records[n].state == SILENT
                and now - records[n].since >= self.options.recovery.hang_timeout]

    def state(self, name: str) -> str:
        try:
            return self.cluster.task(name).state
        except Exception:  # noqa: BLE001 - a task scaled away counts as lost
            return LOST

    # -- faults ------------------------------------------------------------------------------

    def fault(self, task: str, kind: str, detail: str, action: str) -> Fault:
        """Record a fault (once per task until it is over), flag it on the dashboards and say it in the notebook."""
        fault = self._open.get(task)
        if fault is not None and fault.kind == kind == "straggler":
            fault.count += 1
        if fault is None or fault.kind != kind:
            fault = Fault(task, kind, time.time(), self.job.steps_done, detail, action)
            self._open[task] = fault
            self.job.faults_found.append(fault)
            self.cluster.health.flag(task, kind, detail, self.job.name)
            self.say(task, kind, f"{task} {detail} at step {fault.step}: {self._plan(action)}")
        else:
            fault.action = action
        return fault

    @staticmethod
    def _plan(action: str) -> str:
        return {"re-hosted": "re-hosting it on a new engine; training goes on with the others meanwhile",
                "restored": "re-hosting it and restoring the newest checkpoint",
                "dropped": "going on without it", "waited": "waiting for it"}.get(action, action)

    def settle(self, task: str, action: str, detail: str = "") -> Fault | None:
        """The open fault of ``task`` is over (``action`` says how); says so once in the notebook."""
        fault = self._open.pop(task, None)
        if fault is not None:
            fault.action, fault.recovered = action, time.time()
            if detail:
                fault.detail += f"; {detail}"
            self.cluster.health.flag(task, action, detail or f"after {fault.seconds:.1f} s", self.job.name)
            self.say(task, action, f"{task} is back after {fault.seconds:.1f} s ({action}){': ' + detail if detail else ''}.")
        return fault

    def say(self, task: str, kind: str, message: str) -> None:
        if (task, message) in self._warned or self.job.stop_requested or self.cluster.health.closing:
            return  # a job being stopped, or a cluster stopping, loses its tasks on purpose
        self._warned.add((task, message))
        notice(f"job {self.job.name}: {message}", TaskFaultWarning, f"job {self.job.name}")

    # -- re-hosting --------------------------------------------------------------------------

    def rehosting(self, task: str) -> bool:
        """Whether ``task``'s re-hosting is under way (what the job keeps on it is made again when it is back)."""
        running = self._rehosting.get(task)
        return running is not None and running.is_alive()

    def rehost(self, task: str, rebuild: Callable[[], None]) -> None:
        """Re-host ``task`` on a new engine, then ``rebuild()`` what the job kept there; in the background.

        ``rebuild`` also brings this kernel's connection to the new server (``connection.refresh``), when the
        job's calls allow it; a job that ended meanwhile leaves that to the next ``connect()``."""
        running = self._rehosting.get(task)
        if running is not None and running.is_alive():
            return

        def run() -> None:
            try:
                self.cluster.replace_task(task, refresh_connection=False)  # kills the old engine first if it hangs
                if self.closed:
                    return  # the job ended meanwhile: the task is back for the next job, with nothing to rebuild
                rebuild()
            except Exception as exc:  # noqa: BLE001 - the job goes on without it, and says why
                self.settle(task, "failed", f"re-hosting failed: {first_line(exc, 300)}")
                self._back.put((task, False))
                return
            self._back.put((task, True))

        thread = threading.Thread(target=run, daemon=True, name=f"workbench-rehost-{task}")
        self._rehosting[task] = thread
        thread.start()


def is_infrastructure_error(exc: BaseException) -> bool:
    """An error that says a task went away (or cannot be reached), not a bug in the model or data."""
    return type(exc).__name__ in _INFRASTRUCTURE_ERRORS


def lost_ps(job) -> list[str]:
    """The ps tasks that are gone: their engines exited (health), or their servers refuse connections."""
    records = {r.name: r for r in job.cluster.tasks}
    return [name for name in job.trainer.restore_tasks if name not in records or records[name].state in (LOST, RECOVERING)
            or connection.connect_problem(records[name].address, 2.0)]


def classify(job, exc: BaseException, where: str) -> BaseException:
    """A remote call's error: ``TaskLost`` if a ps is gone, a ``ClusterStateError`` for a lost worker, else a bug."""
    if not is_infrastructure_error(exc):
        return TrainingError(f"a step on {where} failed: {type(exc).__name__}: {getattr(exc, 'message', exc)}"
                             f"{native_logs.hint()}")
    lost = lost_ps(job)
    deadline = time.monotonic() + PS_CONFIRM_SECONDS
    while not lost and time.monotonic() < deadline and not engine_exited(job, where):
        # A ps being killed drops its connections a moment before its listening port closes (and
        # before its engine counts as exited): look again before calling it something else.
        time.sleep(0.1)
        lost = lost_ps(job)
    if lost:
        return ps_lost(job, lost)
    return ClusterStateError(f"{where} was lost: {type(exc).__name__}.{native_logs.hint()}")


def engine_exited(job, task: str) -> bool:
    """The health monitor saw ``task``'s engine exit: its own loss explains the failed call (no ps to confirm)."""
    records = {r.name: r for r in job.cluster.tasks}
    return task in records and records[task].state == LOST


def ps_lost(job, lost: list[str]) -> TaskLost:
    step = job.start_step + job.steps_done
    where = (f"resume from {job.last_checkpoint} with wb.train(..., checkpoint=wb.Checkpoint(directory, resume=True)) "
                 "on a new cluster"
             if job.last_checkpoint else "no checkpoint was written (pass checkpoint=wb.Checkpoint(directory, every=...))")
    names = ", ".join(lost)
    error = ParameterServerLost(
        f"the {job.trainer.holders} {names} ({', '.join(_where(job, n) for n in lost)}) is unreachable, so "
        f"the model's variables are lost at step {step}: {where}.")
    return TaskLost(lost, "was lost (the model's variables lived there)", error)


def _where(job, name: str) -> str:
    record = job.cluster.task(name)
    return f"{record.task.device} at {record.address}"


def restore_after_loss(job, lost: TaskLost) -> None:
    """Re-host the lost tasks, rebuild the job's variables, restore this job's newest checkpoint, go on from it."""
    if job.recoveries >= MAX_RESTORES:
        raise TrainingError(f"{', '.join(lost.tasks)} {lost.why}, after {job.recoveries} restores already in this job: "
                            "giving up (check what kills the task: cluster.status(), the engines' memory).")
    label = lost.label
    source = job.last_checkpoint or ("the initial weights (no checkpoint yet: pass checkpoint=wb.Checkpoint(directory, "
                                     "every=...) to redo less)")
    fault = job.supervisor.fault(label, "lost", lost.why, "restored")
    fault.detail += f"; restoring {source}"
    # the dead first: re-hosting a live task updates this kernel's connection, which needs every other task up
    for task in sorted(lost.tasks, key=lambda name: not engine_exited(job, name)):
        job.cluster.replace_task(task, refresh_connection=job.trainer.uses_connection)
    fault.redone = job.restore_checkpoint()  # the steps after the checkpoint run again
    fault.resumed_from = job.start_step + job.steps_done
    job.recoveries += 1
    job.report_progress()
    job.supervisor.settle(label, "restored", f"resumed from step {fault.resumed_from}; {fault.redone} step(s) to run again")
