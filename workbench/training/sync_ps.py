"""sync-ps: each step aggregates the first N - k gradients to arrive, and drops the late ones.

Each worker computes on its own replica of the model and keeps its gradient in a buffer on itself;
the run's thread (the job's) waits for enough gradients, then has the ps tasks read exactly those
workers' buffers and apply their average. A worker that is lost (or hung and dropped) no longer
counts towards a step: the steps go on with the gradients of the others (``aggregated`` in the
history says how many) until it is back.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

from ..cluster.health import RUNNING
from ..errors import ClusterStateError
from ..telemetry.events import APPLY, COMPUTE, PULL
from .building import build_model
from .runs import WorkerRun
from .workers import ACTIVE, DROPPED, RECOVERING, TICK_SECONDS, own_executor


@dataclass
class _Arrival:
    index: int
    name: str
    loss: float
    metrics: list
    stamps: list  # worker-side start and end of the gradient (after the pull)


class SyncRun(WorkerRun):
    """One run of a sync-ps job's loop, from its missing steps to the end (or to a lost ps)."""

    def __init__(self, job):
        super().__init__(job)
        self.cond = threading.Condition()
        self.current = -1  # the step the workers compute now
        self.results: dict[int, list[_Arrival]] = defaultdict(list)  # step -> arrivals, in the order they came
        self.computing: dict[int, tuple[int, float, bool]] = {}  # worker -> (step, monotonic start, flagged)
        self.given_up: dict[int, set[int]] = defaultdict(set)  # step -> workers not waited for (dropped stragglers)
        self.left_out: list[tuple[int, int]] = []  # (step, worker) not waited for by policy ("drop")
        self.required = self.options.required_gradients
        self.aggregated = 0

    def _replica(self, index: int) -> tuple:
        """Worker ``index``'s copy of the model, and its gradient buffer: both on that worker."""
        import tensorflow as tf

        job = self.job
        with tf.device(job._worker_devices[index]):
            replica = build_model(job._model_source, tf.zeros(job._example_shape, job._example_dtype))
            buffer = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False, name=f"grad_{i}")
                      for i, v in enumerate(job._model.trainable_variables)]
        return replica, buffer

    def _rebuild(self, index: int) -> None:
        super()._rebuild(index)
        self.job._fns.set_worker(index, *self._replica(index))
        self._prepare_apply([index])

    def run(self) -> None:
        job = self.job
        replicas, buffers = zip(*(self._replica(i) for i in self.slots))
        job._fns.build_sync(list(replicas), list(buffers))
        self._prepare_apply(list(self.slots))
        next_checkpoint = job.first_checkpoint_at()
        finished = False
        try:
            for index in self.slots:
                self._launch(index)
            for step in job.missing_steps():
                if job._stop.is_set():
                    break
                while (arrived := self._gather(step)) is not None and not self._apply(step, arrived):
                    pass  # a contributor was lost before the ps read its gradient: gather again
                next_checkpoint = job.checkpoint_due(next_checkpoint)
            finished = True
        finally:
            self.halt.set()
            with self.cond:
                self.cond.notify_all()
        if finished:
            self._join()
        with self.cond:
            late = sum(len(v) for v in self.results.values()) - self.aggregated
            # a gradient left out by policy that never came counts like a late one (on_hang / on_straggler = "drop")
            never = sum(1 for step, index in self.left_out if index not in {a.index for a in self.results.get(step, ())})
            job.dropped_gradients += late + never

    def _prepare_apply(self, workers: list[int]) -> None:
        """Trace, now, the apply functions a step can need with one worker out (lost, dropped, or late).

        Every set of N - k contributors, and with k = 0 every set of N - 1, that includes one of
        ``workers``: a function traced later, while a worker is stopped, would freeze the kernel
        (``StepFunctions.prepare_apply``). Two workers out at once may still need a new one.
        """
        import tensorflow as tf

        n, need = len(self.slots), self.required
        sizes = {need} | ({n - 1} if need == n and n > 1 else set())
        sets = [c for size in sizes for c in itertools.combinations(range(n), size) if set(c) & set(workers)]
        with tf.device(self.job._ps_devices[0]):
            self.job._fns.prepare_apply(sets)

    def _has_work(self) -> bool:
        return not self.halt.is_set()

    # -- the run's thread: one step ------------------------------------------------------------

    def _gather(self, step: int) -> list[_Arrival]:
        """Wait for this step's gradients: the first N - k, or as many as the workers still there can give."""
        from .job import TrainingError

        with self.cond:
            self.current = step
            self.cond.notify_all()
        deadline = time.monotonic() + self.options.step_timeout
        while True:
            self._tick()
            with self.cond:
                usable = [a for a in self.results[step] if self.slots[a.index] == ACTIVE]
                active = sum(s == ACTIVE for s in self.slots.values())
                awaited = [i for i, s in self.slots.items() if s == ACTIVE and i not in self.given_up[step]]
                need = min(self.required, len(awaited))
                if usable and len(usable) >= need:
                    return usable[:need] if need else usable
                if not active and not any(s in (RECOVERING, DROPPED) for s in self.slots.values()):
                    raise TrainingError(f"every worker was lost ({', '.join(self.names)}) at sync-ps step {step}: check "
                                        "cluster.status().")
                if time.monotonic() > deadline:
                    raise TrainingError(
                        f"sync-ps step {step} waited {self.options.step_timeout:.0f} s for {self.required} gradient(s) and got "
                        f"{len(usable)}: check the workers (cluster.status()), add backup_workers, or raise step_timeout.")
                self.cond.wait(TICK_SECONDS)

    def _apply(self, step: int, arrived: list[_Arrival]) -> bool:
        """Average and apply the gradients of ``arrived`` on the ps tasks; False if one of them is gone."""
        import tensorflow as tf

        job = self.job
        contributors = tuple(sorted(a.index for a in arrived))
        try:
            with tf.device(job._ps_devices[0]):  # wait until every update landed: the next pulls read them
                applied = job._fns.apply_gradients(contributors).numpy()
        except Exception as exc:  # noqa: BLE001 - classified
            error = job._classify(exc, "the ps tasks")
            if not isinstance(error, ClusterStateError):
                raise error from None
            gone = [i for i in contributors if self.supervisor.state(self.names[i]) != RUNNING]
            if not gone:
                raise error from None
            for index in gone:
                self.worker_lost(index, "was lost before the ps read its gradient")
            return False
        n = len(arrived)
        job._recorder.span(job._ps_names[0], job._ps_devices[0], APPLY, step, applied[0], applied[1],
                           n * self.options.per_worker_batch)
        loss = sum(a.loss for a in arrived) / n
        metrics = [sum(a.metrics[i] for a in arrived) / n for i in range(len(job.metric_names))]
        job._record(step, loss, metrics, ",".join(a.name for a in arrived), min(a.stamps[0] for a in arrived),
                    max(a.stamps[1] for a in arrived), n * self.options.per_worker_batch, aggregated=n)
        self.aggregated += n
        return True

    # -- a worker's thread ---------------------------------------------------------------------

    def _next_step(self, index: int, last: int) -> int | None:
        with self.cond:
            while self.current <= last and not self.halt.is_set() and not self.job._stop.is_set():
                self.cond.wait(0.5)
            if self.halt.is_set() or self.job._stop.is_set() or self.slots[index] not in (ACTIVE, DROPPED):
                return None
            self.computing[index] = (self.current, time.monotonic(), False)
            return self.current

    @own_executor
    def _work(self, index: int) -> None:
        import tensorflow as tf

        job, name, device = self.job, self.names[index], self.job._worker_devices[index]
        last = -1
        while (step := self._next_step(index, last)) is not None:
            key = job._recorder.call_started(name, device, step, 1)
            try:
                with tf.device(device):
                    loss, metrics, stamps = job._fns.worker_step[index](job._iterators[index])
                loss, metrics, stamps = float(loss.numpy()), metrics.numpy(), stamps.numpy()
            except Exception as exc:  # noqa: BLE001 - the run's thread decides what it means
                job._recorder.call_ended(key)
                self.errors.put((index, threading.current_thread(), exc))
                return
            with self.cond:
                started = self.computing.pop(index, (step, time.monotonic(), False))[1]
                if self.halt.is_set():
                    return
                self.results[step].append(_Arrival(index, name, loss, metrics, stamps[1:]))
                self.cond.notify_all()
            self.times.add(time.monotonic() - started)
            job._recorder.span(name, device, PULL, step, stamps[0], stamps[1])
            job._recorder.span(name, device, COMPUTE, step, stamps[1], stamps[2], self.options.per_worker_batch, key)
            last = step

    # -- what the run's thread does about it -------------------------------------------------------

    def _current(self, index: int, token) -> bool:
        return self.threads.get(index) is token and self.slots[index] in (ACTIVE, DROPPED)

    def _leave_out(self, index: int) -> None:
        with self.cond:
            self.left_out.append((self.current, index))
        self._abandon(index)

    def _abandon(self, index: int) -> None:
        """Worker ``index``'s gradient for the current step is not waited for (if it comes, it may still count)."""
        with self.cond:
            self.given_up[self.current].add(index)
            self.cond.notify_all()

    def _check_calls(self) -> None:
        now = time.monotonic()
        with self.cond:
            computing = [(i, s, start, flagged) for i, (s, start, flagged) in self.computing.items() if s == self.current]
        for index, step, started, flagged in computing:
            elapsed = now - started
            if elapsed > self.options.step_timeout:
                self._overdue(index, elapsed)
                continue
            limit = self.times.limit(self.options.straggler_factor)
            if limit is not None and elapsed > limit and not flagged:
                with self.cond:
                    if index in self.computing:
                        self.computing[index] = (step, started, True)
                self._straggles(index, self._straggler_detail(1, elapsed))
