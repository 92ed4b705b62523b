"""What the runs of the ps strategies share: worker slots and threads, and what they do about failing tasks.

A run (``AsyncRun``, ``SyncRun``) is one pass of a job's loop over its missing steps. Its thread
(the job's) looks every tick at what the workers' threads report and at the tasks' health
(``Supervisor``), and acts:

* a worker whose engine exited, or whose call failed while the ps tasks are fine, is **lost**: its
  work goes to the others; with ``Recovery.rehost`` it is re-hosted in the background and comes back;
* a task silent for ``hang_timeout`` is handled by ``on_hang``: ``replace`` (kill and re-host it),
  ``drop`` (go on without it until it answers) or ``wait`` (flag it and wait, up to ``step_timeout``);
* a call ``straggler_factor`` times its peers' median is handled by ``on_straggler`` the same way;
* a lost ps ends the run with ``TaskLost``; the job re-hosts it and restores its checkpoint.
"""

from __future__ import annotations

import queue
import threading
import time

from ....cluster.health import CONTROLLER_LOST, LOST, RUNNING
from ....errors import ControllerLost, first_line
from ...job.recovery import CallTimes, TaskLost, classify, ps_lost
from ...job.workers import ACTIVE, DROPPED, RECOVERING, THREAD_JOIN_SECONDS, WorkersChanged
from ...job.workers import LOST as SLOT_LOST


class WorkerRun:
    """Slots, threads and fault handling of one run; subclasses say how a worker works and what it abandons."""

    def __init__(self, job, trainer):
        self.job, self.trainer = job, trainer  # the job's public side, and its PsTrainer (functions, pipelines)
        self.options = job.options
        self.supervisor = job.supervisor
        self.names = [r.name for r in job.workers]
        # a worker whose re-hosting an earlier run began (before a scale) takes work once it is back
        self.slots = {i: RECOVERING if self.supervisor.rehosting(name) else ACTIVE for i, name in enumerate(self.names)}
        self.threads: dict[int, threading.Thread] = {}
        self.errors: queue.SimpleQueue = queue.SimpleQueue()  # (worker index, token, error); index None: token names it
        self.times = CallTimes()
        self.halt = threading.Event()
        self.draining = False  # the cluster was scaled: no new work; the run ends once its calls are back

    # -- to be provided by each strategy -------------------------------------------------------

    def _work(self, index: int) -> None:
        raise NotImplementedError

    def _abandon(self, index: int) -> None:
        """Worker ``index``'s current work will not count: hand it to the others."""
        raise NotImplementedError

    def _current(self, index: int, token) -> bool:
        """Whether ``token`` (what failed) is still worker ``index``'s current work."""
        raise NotImplementedError

    def _leave_out(self, index: int) -> None:
        """Policy ``"drop"``: worker ``index``'s current work will not count (as if it came late)."""
        self._abandon(index)

    def _rebuild(self, index: int) -> None:
        """Worker ``index`` was re-hosted: make again what the run keeps on it (and reach it: ``rebuild_worker``)."""
        self.trainer.rebuild_worker(index)

    def _has_work(self) -> bool:
        raise NotImplementedError

    # -- threads -------------------------------------------------------------------------------

    def _launch(self, index: int) -> None:
        thread = threading.Thread(target=self._work, args=(index,), daemon=True, name=f"workbench-{self.names[index]}")
        self.threads[index] = thread
        thread.start()

    def _relaunch(self) -> None:
        if not self._has_work() or self.job.stop_requested or self.draining:
            return
        for index, slot in list(self.slots.items()):
            if slot == ACTIVE and not self.threads[index].is_alive():
                self._launch(index)

    def _join(self) -> None:
        deadline = time.monotonic() + THREAD_JOIN_SECONDS
        for index, thread in self.threads.items():
            if self.slots[index] == ACTIVE:  # threads stuck in a hung call are left behind (daemons)
                thread.join(max(0.0, deadline - time.monotonic()))

    def _tick(self) -> None:
        """What the run's thread does every tick: failures, health, stragglers, workers back, idle threads."""
        self._handle_errors()
        self._handle_health()
        self._check_calls()
        self._handle_rehosted()
        if self.job.rescale_pending():
            self.draining = True  # the job follows at this step boundary: the next run has the new workers
        self._relaunch()

    def _changed_workers(self) -> WorkersChanged | None:
        """After a drained run: what tells the job to adopt the new workers; None when nothing is left to run."""
        job = self.job
        if self.draining and not job.stop_requested and not job.loop.finished and job.missing_steps():
            return WorkersChanged(time.time())
        return None

    # -- failures ------------------------------------------------------------------------------

    def _handle_errors(self) -> None:
        from ....errors import ClusterStateError

        while True:
            try:
                index, token, exc = self.errors.get_nowait()
            except queue.Empty:
                return
            if isinstance(exc, TaskLost):
                raise exc
            if index is None:  # the token names what failed
                raise classify(self.job, exc, token or "the job's checkpointing")
            if not self._current(index, token):
                continue  # work given up on already, failing late: it was done elsewhere
            error = classify(self.job, exc, self.names[index])
            if not isinstance(error, ClusterStateError):
                raise error
            self.worker_lost(index, f"failed a call ({type(exc).__name__}: {first_line(exc)})")

    def worker_lost(self, index: int, detail: str) -> None:
        """Worker ``index`` is gone (or hangs, to be replaced): its work goes to the others; re-host it if allowed."""
        name = self.names[index]
        self._abandon(index)
        if self.slots[index] in (RECOVERING, SLOT_LOST):
            return
        if self.options.recovery.rehost:
            self.slots[index] = RECOVERING
            self.supervisor.fault(name, "lost", detail, "re-hosted")
            self.supervisor.rehost(name, lambda: self._rebuild(index))
        else:
            self.slots[index] = SLOT_LOST
            self.supervisor.fault(name, "lost", detail, "dropped")
            self.job.lost_workers.append(name)

    def _drop(self, index: int, kind: str, detail: str) -> None:
        """Go on without worker ``index`` until it answers again (``on_hang`` / ``on_straggler`` = ``"drop"``)."""
        self._leave_out(index)
        self.slots[index] = DROPPED
        self.supervisor.fault(self.names[index], kind, detail, "dropped")

    def _handle_health(self) -> None:
        for event in self.supervisor.events():
            if event.kind == CONTROLLER_LOST:
                raise ControllerLost(event.detail)
            if event.kind == LOST and self.supervisor.state(event.task) != LOST:
                continue  # told before a re-hosting that is over now
            back = event.kind == RUNNING and event.detail == "answering again"
            if event.task in self.trainer.restore_tasks:
                if event.kind == LOST:
                    raise ps_lost(self.job, [event.task])
                if back:
                    self.supervisor.settle(event.task, "waited", "answering again")
            if event.task not in self.names:
                continue
            index = self.names.index(event.task)
            if event.kind == LOST and self.slots[index] in (ACTIVE, DROPPED):
                self.worker_lost(index, "its engine exited")
            elif back and self.slots[index] in (ACTIVE, DROPPED):
                action = "dropped" if self.slots[index] == DROPPED else "waited"
                self.slots[index] = ACTIVE  # a dropped one takes work again once its old call returns
                self.supervisor.settle(event.task, action, "answering again")
        self._handle_hangs()

    def _handle_hangs(self) -> None:
        policy, seconds = self.options.recovery.hang_policy, self.options.recovery.hang_timeout
        detail = f"answered nothing for {seconds:.0f} s"
        for name in self.supervisor.hung(self.trainer.restore_tasks):
            if policy == "replace":
                raise TaskLost([name], detail, ps_lost(self.job, [name]).error)
            self.supervisor.fault(name, "silent", detail, "waited")  # a ps cannot be left out
        active = [n for i, n in enumerate(self.names) if self.slots[i] == ACTIVE]
        for name in self.supervisor.hung(active):
            index = self.names.index(name)
            if policy == "replace":
                self.worker_lost(index, detail)
            elif policy == "drop":
                self._drop(index, "silent", detail)
            else:
                self.supervisor.fault(name, "silent", detail, "waited")

    def _straggles(self, index: int, detail: str) -> None:
        """A call of worker ``index`` straggles: ``on_straggler`` says what to do."""
        policy = self.options.recovery.on_straggler
        if policy == "replace":
            self.worker_lost(index, detail)
        elif policy == "drop":
            self._leave_out(index)  # its work goes to the others; its late result is dropped
            self.supervisor.fault(self.names[index], "straggler", detail, "dropped")
        else:
            self.supervisor.fault(self.names[index], "straggler", detail, "waited")

    def _overdue(self, index: int, seconds: float) -> None:
        """A call ran past ``step_timeout``: replace the worker (``Recovery.rehost``), or give up on it."""
        detail = f"ran one call for more than step_timeout={self.options.recovery.step_timeout:.0f} s"
        if self.options.recovery.rehost:
            self.worker_lost(index, detail)
        else:
            self._abandon(index)
            self.slots[index] = SLOT_LOST
            self.supervisor.fault(self.names[index], "silent", detail, "dropped")
            self.job.lost_workers.append(self.names[index])

    def _check_calls(self) -> None:
        raise NotImplementedError

    def _handle_rehosted(self) -> None:
        for name, ok in self.supervisor.rehosted():
            if name not in self.names:
                continue
            index = self.names.index(name)
            if ok and self.slots[index] in (RECOVERING, ACTIVE):  # ACTIVE: back before this run began
                self.slots[index] = ACTIVE
                self.supervisor.settle(name, "re-hosted", f"on engine {self.job.cluster.task(name).engine_id}")
            elif not ok:
                self.slots[index] = SLOT_LOST
                self.job.lost_workers.append(name)

    def _straggler_detail(self, steps: int, elapsed: float) -> str:
        return (f"straggles: a call of {steps} step(s) ran {elapsed:.1f} s, over {self.options.recovery.straggler_factor:g}x "
                "its peers' median")
