"""What a training job does when one of its tasks fails: notice, decide, re-host, restore, report.

A job's ``Supervisor`` subscribes to its cluster's task health (``cluster.health``): engines that
exit are ``lost`` at once, engines that stop answering are ``silent``. The job's loops ask it each
tick what changed, and it does the slow part (re-hosting a task on a new engine, then rebuilding
what the job kept there) in a thread of its own, so that training goes on with the other workers
meanwhile. Every fault becomes a ``Fault`` in ``job.faults``, a ``TaskEvent`` on the dashboards'
timeline, and one ``TaskFaultWarning`` in the notebook.

Tasks whose loss the job cannot absorb in place (a ps: the variables lived there; an all-reduce
worker: the group must be formed again) end the current run with ``TaskLost``; the job then
re-hosts them and restores the newest checkpoint (``Job._recover_state``).
"""

from __future__ import annotations

import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ..cluster.health import LOST, SILENT
from ..errors import TaskFaultWarning
from ..native_logs import notice
from ..telemetry.events import TaskEvent

MIN_STRAGGLER_SECONDS = 1.0  # a call shorter than this is never a straggler, whatever its peers do
STRAGGLER_SAMPLES = 8  # completed calls needed before calls are compared with their median


class TaskLost(Exception):
    """Tasks a run cannot go on without were lost; ``error`` is what a job with ``recover=False`` raises."""

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
                and now - records[n].since >= self.options.hang_timeout]

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
            self.job._faults.append(fault)
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
        if (task, message) in self._warned or self.job._stop.is_set() or self.cluster.health.closing:
            return  # a job being stopped, or a cluster stopping, loses its tasks on purpose
        self._warned.add((task, message))
        notice(f"job {self.job.name}: {message}", TaskFaultWarning, f"job {self.job.name}")

    # -- re-hosting --------------------------------------------------------------------------

    def rehost(self, task: str, rebuild: Callable[[], None]) -> None:
        """Re-host ``task`` on a new engine, then ``rebuild()`` what the job kept there; in the background."""
        running = self._rehosting.get(task)
        if running is not None and running.is_alive():
            return

        def run() -> None:
            try:
                self.cluster.replace_task(task)  # kills the old engine first if it still runs (hung)
                if self.closed:
                    return  # the job ended meanwhile: the task is back for the next job, with nothing to rebuild
                rebuild()
            except Exception as exc:  # noqa: BLE001 - the job goes on without it, and says why
                self.settle(task, "failed", f"re-hosting failed: {exc}")
                self._back.put((task, False))
                return
            self._back.put((task, True))

        thread = threading.Thread(target=run, daemon=True, name=f"workbench-rehost-{task}")
        self._rehosting[task] = thread
        thread.start()
