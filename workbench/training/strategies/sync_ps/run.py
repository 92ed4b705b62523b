"""sync-ps: each step aggregates the first N - k gradients to arrive, and drops the late ones.

The barrier runs on the first ps (``steps.py``: ``SyncBarrier``): workers run ``steps_per_call``
synchronous steps per remote call, each blocking on the ps for its step's token, and the ps
applies every step once ``required`` gradients of it arrived. The kernel is not in any step's
loop: one thread per worker makes its calls (a chunk of steps each), one makes the ps's
``aggregate`` call of each chunk ahead of its gradients (the ps then drives the chunk's steps by
itself) and records its steps, and the run's thread watches the tasks' health and lowers
``required`` when a worker is lost, hung or dropped (the steps then go on with the gradients of
the others; ``aggregated`` in the history says how many) and raises it again when the worker is
back.
"""

from __future__ import annotations

import functools
import statistics
import threading
import time

from ....telemetry.events import APPLY, COMPUTE
from ...job.workers import ACTIVE, DROPPED, RECOVERING, TICK_SECONDS, own_executor, wait_until
from ...modelling.steps import host_scalar
from ..async_ps import chunks_of
from ..ps.runs import WorkerRun
from .steps import SyncBarrier

_AGGREGATOR = "the ps tasks' aggregation"


class SyncRun(WorkerRun):
    """One run of a sync-ps job's loop, from its missing steps to the end (or to a lost ps)."""

    def __init__(self, job, trainer):
        super().__init__(job, trainer)
        self.chunks = chunks_of(job.missing_steps(), self.options.strategy.steps_per_call, self.options.epoch_steps)
        self.chunk = 0  # the chunk of steps the workers' calls make now
        self.step_started = time.monotonic()  # when the ps's call in flight (of ``chunks[chunk]``) was made
        self.aggregated = 0
        self.late = 0
        self.excluded: set[int] = set()  # dropped stragglers: not waited for until the chunk ends
        self.required = -1  # what the ps was told last
        self.barrier: SyncBarrier | None = None
        self.aggregator: threading.Thread | None = None
        self.straggling: list[tuple[int, str]] = []  # (worker, detail) found by the workers' threads
        self.parked = False  # the aggregator waits for the loop to release the next epoch (or to end the last)
        self.wake = threading.Event()  # the aggregator parked: the run's thread ends the epoch now, not at its next tick

    def run(self) -> None:
        job, trainer = self.job, self.trainer
        if not self.chunks:
            return
        self.required = self._needed()
        self.barrier = SyncBarrier(trainer.fns, len(self.slots), len(job.metric_names), trainer.ps_devices[0], self.required)
        self.barrier.start(self.chunks[0][0])
        self.barrier.warm_up(trainer.iterators, trainer.worker_devices, self.chunks[0][0],
                             skip={i for i, slot in self.slots.items() if slot != ACTIVE})
        finished = False
        try:
            for index in self.slots:
                self._launch(index)
            self.aggregator = threading.Thread(target=self._aggregate, daemon=True, name="workbench-sync-aggregator")
            self.aggregator.start()
            while self.aggregator.is_alive():
                self.job.loop.tick(self.parked)
                self._tick()
                self._sync_required()
                self.wake.wait(TICK_SECONDS)
                self.wake.clear()
            self._handle_errors()
            finished = True
        finally:
            self.halt.set()
            self._end(finished)
        changed = self._changed_workers()
        if changed is not None:
            raise changed

    def _end(self, finished: bool) -> None:
        """Count what came late, then close the queues: calls still blocked on them (a hung worker's) end."""
        try:
            if finished and (self.job.stop_requested or self.job.loop.stopped_early or self.draining):
                # stopped (by the user, or by a callback mid-epoch), or drained for a scale: the workers' calls of the
                # next chunk wait for tokens that will not come; end them now (its steps run in the next run)
                self.barrier.close()
                self._join()
                return
            if finished:
                self._join()
                self.late += self.barrier.leftover()
            self.barrier.close()
        except Exception:  # noqa: BLE001 - a lost ps took its queues with it
            pass
        self.job.dropped_gradients += self.late

    def _needed(self) -> int:
        """Gradients a step waits for: N - k, or what the workers still taking part can give (at least 1)."""
        taking_part = sum(1 for i, s in self.slots.items() if s == ACTIVE and i not in self.excluded)
        return max(1, min(self.options.required_gradients, taking_part))

    def _sync_required(self) -> None:
        needed = self._needed()
        if needed != self.required and not self.halt.is_set():
            self.barrier.set_required(needed)
            self.required = needed

    def _has_work(self) -> bool:
        return not self.halt.is_set() and self.chunk < len(self.chunks) and not self.draining

    def _rebuild(self, index: int) -> None:
        super()._rebuild(index)
        self.barrier.rebuild_worker(index)

    # -- the aggregator's thread: the ps applies chunk after chunk, the history is recorded ------

    @own_executor
    def _aggregate(self) -> None:
        """One ``aggregate`` call per chunk of steps: the ps applies them one after the other by itself.

        The call is made before the chunk's first gradients come (the workers compute meanwhile), so
        this thread's round trip to the ps overlaps the workers' compute instead of adding to it, and
        the kernel pays one remote call per ``steps_per_call`` steps (it was one per step: a third of
        a step's CPU time on a small model). The chunk's records reach the history when it returns,
        as an async-ps call's do.
        """
        import tensorflow as tf

        job = self.job
        for number, (first, n) in enumerate(self.chunks):
            if self.draining or not self._wait_for_release(first):
                return  # a scale: the chunk runs in the next run, on the new workers
            self.chunk = number
            self.excluded.clear()
            following = self.chunks[number + 1][0] if number + 1 < len(self.chunks) else first + n
            if self.halt.is_set() or job.stop_requested:
                return
            with self.trainer.gate.call(first, self._over) as going:
                if not going:
                    return
                self.step_started = time.monotonic()
                try:
                    bounds = [host_scalar(v, tf.int64) for v in (first, first + n, following)]
                    with tf.device(self.trainer.ps_devices[0]):
                        rows = self.barrier.aggregate(*bounds)
                    rows = rows.numpy()
                except Exception as exc:  # noqa: BLE001 - the run's thread decides what it means
                    self.errors.put((None, _AGGREGATOR, exc))
                    return
            try:
                self._record(first, [self.barrier.unpack(row) for row in rows])  # and a checkpoint, if one is due
            except Exception as exc:  # noqa: BLE001 - a save that found a ps gone (TaskLost), or a failure
                self.errors.put((None, None, exc))
                return
        self.chunk = len(self.chunks)
        self._wait_for_release(self.options.steps)  # parked until the loop has ended the last epoch

    def _wait_for_release(self, first: int) -> bool:
        """The aggregator's wait until step ``first`` may run (parked meanwhile); False: the run ends here."""
        loop = self.job.loop
        if loop.claimable(first):
            return True
        self.parked = True
        self.wake.set()
        try:
            released = wait_until(functools.partial(loop.claimable, first), self._over, None)
        finally:
            self.step_started = time.monotonic()  # the wait is not the step's: step_timeout counts from here
            self.parked = False
        return released

    def _over(self) -> bool:
        """A thread waiting for the next epoch gives up: the loop finished, the run ended, or the job was stopped."""
        return self.job.loop.finished or self.halt.is_set() or self.job.stop_requested or self.draining

    def _record(self, first: int, rows: list[tuple]) -> None:
        """Steps ``first, first + 1, ...``, one ``SyncBarrier.unpack``-ed row each, into the history and the timeline."""
        job, batch = self.job, self.options.per_worker_batch
        ps, ps_device = self.trainer.restore_tasks[0], self.trainer.ps_devices[0]
        records = []
        for i, (mask, losses, metrics, stamps, applied, late) in enumerate(rows):
            contributors = [w for w in range(len(self.names)) if mask[w] > 0]
            n = len(contributors)
            job.recorder.span(ps, ps_device, APPLY, first + i, applied[0], applied[1], n * batch)
            records.append(job.step_record(
                first + i, float(sum(losses[w] for w in contributors) / n),
                [float(sum(metrics[w][j] for w in contributors) / n) for j in range(len(job.metric_names))],
                ",".join(self.names[w] for w in contributors), min(stamps[w][0] for w in contributors),
                max(stamps[w][1] for w in contributors), n * batch, aggregated=n))
            self.aggregated += n
            self.late += late
        job.record_call(records)

    # -- a worker's thread: its calls, chunk after chunk ----------------------------------------

    @own_executor
    def _work(self, index: int) -> None:
        import tensorflow as tf

        job, name, device = self.job, self.names[index], self.trainer.worker_devices[index]
        number = self.chunk  # a worker back from a re-hosting starts where the ps is
        while number < len(self.chunks) and not self.halt.is_set() and self.slots[index] in (ACTIVE, DROPPED):
            if self.draining and number > self.chunk:
                return  # the aggregator stops after its chunk: one the ps will not drive is not started
            first, n = self.chunks[number]
            if not wait_until(functools.partial(job.loop.claimable, first), self._over, None):
                return  # the training ended (a callback stopped it) before this epoch
            with self.trainer.gate.call(first, self._over) as going:
                if not going:
                    return
                key = job.recorder.call_started(name, device, first, n)
                try:
                    end = host_scalar(first + n, tf.int64)
                    with tf.device(device):
                        rows = self.barrier.work[index](self.trainer.iterators[index], end)
                    steps, stamps = self.barrier.split_rows(rows.numpy())
                except Exception as exc:  # noqa: BLE001 - the run's thread decides what it means
                    job.recorder.call_ended(key)
                    if not self.halt.is_set():
                        self.errors.put((index, threading.current_thread(), exc))
                    return
                job.recorder.call_ended(key)
            for step, (start, end) in zip(steps, stamps):
                job.recorder.span(name, device, COMPUTE, int(step), start, end, self.options.per_worker_batch)
            self._note_times(index, [end - start for start, end in stamps])
            number = max(number + 1, self.chunk)

    def _note_times(self, index: int, seconds: list[float]) -> None:
        """A worker's gradients took ``straggler_factor`` times its peers' median: it straggles."""
        if not seconds:
            return
        own = statistics.median(seconds)
        limit = self.times.limit(self.options.recovery.straggler_factor)
        for value in seconds:
            self.times.add(value)
        if limit is not None and own > limit:
            self.straggling.append((index, self._straggler_detail(1, own)))

    # -- what the run's thread does about it -------------------------------------------------------

    def _current(self, index: int, token) -> bool:
        return self.threads.get(index) is token and self.slots[index] in (ACTIVE, DROPPED)

    def _abandon(self, index: int) -> None:
        """Worker ``index``'s gradients are not waited for: ``_needed`` leaves it out from now on."""

    def _leave_out(self, index: int) -> None:
        self.excluded.add(index)  # until this chunk ends; its late gradients are dropped and counted

    def _check_calls(self) -> None:
        """The ps's call past ``step_timeout``: the job fails, naming what to check; stragglers are flagged."""
        from ....errors import TrainingError

        while self.straggling:
            index, detail = self.straggling.pop(0)
            if self.slots[index] == ACTIVE:
                self._straggles(index, detail)
        elapsed = time.monotonic() - self.step_started
        if self.chunk < len(self.chunks) and elapsed > self.options.recovery.step_timeout and not self.parked:
            first, n = self.chunks[self.chunk]
            raise TrainingError(
                f"sync-ps steps {first}-{first + n - 1}: the ps's call waited {elapsed:.0f} s for their gradients "
                f"({self.required} a step): check the workers (cluster.status()), add backup_workers, or raise "
                "step_timeout.")
        if not any(s in (ACTIVE, RECOVERING, DROPPED) for s in self.slots.values()):
            raise TrainingError(f"every worker was lost ({', '.join(self.names)}) at sync-ps step "
                                f"{self.chunks[min(self.chunk, len(self.chunks) - 1)][0]}: check cluster.status().")
