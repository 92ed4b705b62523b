"""async-ps: every worker runs chunks of steps, each step applying its own updates on the ps tasks.

Steps are handed out in chunks of ``steps_per_call``; a worker's thread claims the next chunk when
its call returns, so fast workers run more of them. The chunk of a worker that is lost, hung or
given up on goes back to the queue and runs elsewhere (``ps/runs.py``: ``WorkerRun`` decides when).
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass

from ...telemetry.events import PUSH_APPLY
from ..job.workers import ACTIVE, DROPPED, RECOVERING, TICK_SECONDS, own_executor, wait_until
from .ps.runs import WorkerRun


@dataclass
class _Call:
    chunk: tuple[int, int]  # first step, number of steps
    started: float  # time.monotonic()
    key: str  # the telemetry span of the call in progress
    flagged: bool = False  # reported as straggling already, or not to be judged (a worker's first call)


def chunks_of(steps: list[int], size: int, epoch: int = 0) -> list[tuple[int, int]]:
    """Runs of consecutive steps, cut into chunks of at most ``size``: ``[(first, n), ...]`` in order.

    With ``epoch`` (steps per epoch), no chunk spans two epochs: an epoch's last call ends with it.
    """
    chunks: list[tuple[int, int]] = []
    for step in steps:
        if (chunks and chunks[-1][0] + chunks[-1][1] == step and chunks[-1][1] < size
                and not (epoch and step % epoch == 0)):
            chunks[-1] = (chunks[-1][0], chunks[-1][1] + 1)
        else:
            chunks.append((step, 1))
    return chunks


class AsyncRun(WorkerRun):
    """One run of an async-ps job's loop, from its missing steps to the end (or to a lost ps)."""

    def __init__(self, job, trainer):
        super().__init__(job, trainer)
        self.pending = chunks_of(job.missing_steps(), self.options.strategy.steps_per_call, self.options.epoch_steps)[::-1]  # pop() next
        self.in_flight: dict[int, _Call] = {}
        self.warm: set[int] = set()  # workers whose function is set up on the tasks: a call of theirs came back
        self.stalled_since: float | None = None  # when the last worker able to take work went away
        self.wake = threading.Event()  # a worker found the epoch's calls all out: the run's thread looks now

    def run(self) -> None:
        self.trainer.fns.build_async(**self.trainer.async_step_options())
        try:
            for index in self.slots:
                self._launch(index)
            while not self._finished():
                self.job.loop.tick(self._parked())  # first: an epoch's end releases the next one's calls at once
                self._tick()
                self.wake.wait(TICK_SECONDS)
                self.wake.clear()
        finally:  # a run that ends early (a lost ps) does not wait: its workers' calls may hang on that ps
            self.halt.set()
        self._join()
        self.trainer.fns.leave_shared()  # no call of this run is left: a later job may call its functions now
        changed = self._changed_workers()
        if changed is not None:
            raise changed

    def _finished(self) -> bool:
        with self.job.lock:
            if self.in_flight or any(self.threads[i].is_alive() for i, s in self.slots.items() if s == ACTIVE):
                return False
            if self.job.stop_requested or self.job.loop.finished or self.draining:  # stopped; the last epoch ended
                return True  # (or a callback stopped the training); or a scale. Else the loop ends the epoch, or threads
                # take work, next tick
            if not self.pending:
                return False
        if not any(s in (ACTIVE, RECOVERING) for s in self.slots.values()):
            self._fail_if_stalled()
        return False

    def _fail_if_stalled(self) -> None:
        """No worker can take work: wait for dropped ones to answer again, for at most ``step_timeout``."""
        from ...errors import TrainingError

        now = time.monotonic()
        self.stalled_since = self.stalled_since or now
        if DROPPED not in self.slots.values() or now - self.stalled_since > self.options.recovery.step_timeout:
            lost = [n for i, n in enumerate(self.names) if self.slots[i] != ACTIVE]
            raise TrainingError(f"every worker was lost or is hung ({', '.join(lost)}); {self.job.steps_done} of "
                                f"{self.options.steps - self.job.start_step} steps ran. Check cluster.status().")

    def _await_next_epoch(self, index: int) -> bool:
        """Nothing to claim in this epoch: wake the run's thread (it ends the epoch once every call is back) and wait
        for the next one's calls (True), instead of ending the thread; False when there is no next one for it."""
        job = self.job

        def over() -> bool:
            with job.lock:
                return (not self.pending or self.halt.is_set() or job.stop_requested or self.slots[index] != ACTIVE
                        or job.loop.finished or self.draining)

        def released() -> bool:
            with job.lock:
                return self._released()

        if over():
            return False
        self.wake.set()
        return wait_until(released, over, self.options.recovery.step_timeout)

    def _has_work(self) -> bool:
        with self.job.lock:
            return self._released()

    def _released(self) -> bool:
        """A pending chunk may be claimed now (it is in the current epoch); the caller holds the job's lock."""
        return bool(self.pending) and self.job.loop.claimable(self.pending[-1][0])

    def _parked(self) -> bool:
        """No call in flight and none that may start: where the loop may end an epoch."""
        with self.job.lock:
            return not self.in_flight and not self._released()

    # -- a worker's thread ---------------------------------------------------------------------

    def _claim(self, index: int) -> _Call | None:
        """The next chunk of the current epoch, in flight from now (one step under the lock: see ``_parked``)."""
        job = self.job
        with job.lock:
            if (self.halt.is_set() or job.stop_requested or self.slots[index] != ACTIVE or self.draining
                    or not self._released()):
                return None
            first, n = chunk = self.pending.pop()
            # A worker's first call also sets its function up on the worker and the ps (about a second,
            # against milliseconds for its peers' calls): it is not judged as straggling.
            call = _Call(chunk, time.monotonic(),
                         job.recorder.call_started(self.names[index], self.trainer.worker_devices[index], first, n),
                         flagged=index not in self.warm)
            self.in_flight[index] = call
            return call

    def _taken(self, index: int, call: _Call, stamps, marks) -> bool:
        """Under the job's lock: worker ``index``'s call leaves the flight as its steps are recorded, in one step (see
        ``_parked``); False if it was given up on (or the run ended): its steps run, or ran, elsewhere."""
        if self.halt.is_set() or self.in_flight.get(index) is not call:
            return False
        del self.in_flight[index]
        self.job.recorder.steps(self.names[index], self.trainer.worker_devices[index], call.chunk[0], stamps, marks,
                                self.options.per_worker_batch, PUSH_APPLY, call.key)
        return True

    @own_executor
    def _work(self, index: int) -> None:
        import tensorflow as tf

        job, name, device = self.job, self.names[index], self.trainer.worker_devices[index]
        while (call := self._claim(index)) is not None or self._await_next_epoch(index):
            if call is None:
                continue  # the next epoch's calls are out: claim one
            first, n = call.chunk
            try:
                with tf.device(device):
                    outputs = self.trainer.fns.train_steps_on(device)(self.trainer.iterators[index], n)
                losses, metrics, stamps, marks = (o.numpy() for o in outputs)
            except Exception as exc:  # noqa: BLE001 - the run's thread decides what it means
                self.errors.put((index, call, exc))
                return
            records = [job.step_record(first + i, losses[i], metrics[i], name, stamps[i], stamps[i + 1],
                                        self.options.per_worker_batch) for i in range(n)]
            try:  # a due checkpoint is saved right away, in this thread
                if not job.record_call(records, accept=functools.partial(self._taken, index, call, stamps, marks)):
                    return
            except Exception as exc:  # noqa: BLE001 - a save that found a ps gone (TaskLost), or a failure
                self.errors.put((None, None, exc))
                return
            if index in self.warm:  # a first call's set-up says nothing about the pace of steps
                self.times.add(time.monotonic() - call.started, n)
            self.warm.add(index)

    # -- what the run's thread does about it -------------------------------------------------------

    def _rebuild(self, index: int) -> None:
        super()._rebuild(index)
        self.warm.discard(index)  # a new engine: its first call sets the function up again

    def _current(self, index: int, token) -> bool:
        with self.job.lock:
            return self.in_flight.get(index) is token

    def _abandon(self, index: int) -> None:
        """The call of worker ``index`` will not count: its chunk goes back to the queue (its late result is dropped)."""
        with self.job.lock:
            call = self.in_flight.pop(index, None)
            if call is not None:
                self.pending.append(call.chunk)
        if call is not None:
            self.job.recorder.call_ended(call.key)

    def _check_calls(self) -> None:
        """Calls past ``step_timeout`` are given up on; straggling ones are flagged (``on_straggler``)."""
        now = time.monotonic()
        with self.job.lock:
            calls = list(self.in_flight.items())
        for index, call in calls:
            elapsed, n = now - call.started, call.chunk[1]
            if elapsed > self.options.recovery.step_timeout:
                self._overdue(index, elapsed)
                continue
            limit = self.times.limit(self.options.recovery.straggler_factor, n)
            if limit is not None and elapsed > limit and not call.flagged:
                call.flagged = True
                self._straggles(index, self._straggler_detail(n, elapsed))
