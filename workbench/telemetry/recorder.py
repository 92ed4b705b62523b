"""Turns what a training job's calls return into events in the cluster's log.

The numbers come from the workers: each step function returns ``tf.timestamp()`` readings taken
on the worker (start, gradients ready, end of each step), in the result of the call that ran it.
So telemetry rides on calls the job makes anyway: no extra messages, and it is batched by
construction (one result per ``steps_per_call`` steps). The recorder only shifts the readings
onto the kernel's clock and opens/closes the in-progress span of each call.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from .events import COMPUTE, RUNNING, JobProgress, StepDone, StepSpan
from .log import EventLog

_KEYS = itertools.count()


class StepRecorder:
    """Writes one job's step spans, completed steps and progress into an ``EventLog``.

    ``offsets`` maps a task name to how far its clock is ahead of the kernel's (seconds).
    A recorder with ``log=None`` records nothing (``telemetry=False``).
    """

    def __init__(self, log: EventLog | None, job: str, offsets: dict[str, float] | None = None):
        self.log = log
        self.job = job
        self.offsets = dict(offsets or {})

    @property
    def enabled(self) -> bool:
        return self.log is not None

    def _local(self, task: str, t: float) -> float:
        return float(t) - self.offsets.get(task, 0.0)

    def call_started(self, task: str, device: str, first_step: int, steps: int) -> str:
        """A call of ``steps`` steps went out to ``task``: draw it now, complete it when it returns."""
        if self.log is None:
            return ""
        key = f"{self.job}:{next(_KEYS)}"
        self.log.append(StepSpan(task, device, RUNNING, time.time(), None, first_step, steps, job=self.job, key=key))
        return key

    def call_ended(self, key: str) -> None:
        """The call failed or was given up on: its in-progress span goes (its steps run elsewhere)."""
        if self.log is not None and key:
            self.log.close(key)

    def steps(self, task: str, device: str, first_step: int, stamps: Sequence[float], marks: Sequence[float] | None,
              examples: int, after_phase: str, key: str = "") -> None:
        """Steps ``first_step...`` ran on ``task``: step i from ``stamps[i]`` to ``stamps[i + 1]``.

        ``marks[i]`` is when step i's gradients were ready: before it the step computed, after it
        it ran ``after_phase`` (push+apply, allreduce+apply). Without marks a step is one span.
        """
        if self.log is None:
            return
        events = []
        for i in range(len(stamps) - 1):
            start, end = self._local(task, stamps[i]), self._local(task, stamps[i + 1])
            mark = self._local(task, marks[i]) if marks is not None else end
            mark = min(max(mark, start), end)
            events.append(StepSpan(task, device, COMPUTE, start, mark, first_step + i, 1, examples, self.job))
            if mark < end:
                events.append(StepSpan(task, device, after_phase, mark, end, first_step + i, 1, 0, self.job))
        if key:  # the last span completes the in-progress one
            last = events.pop()
            events.append(StepSpan(last.task, last.device, last.phase, last.start, last.end, last.step, last.steps,
                                   last.examples, last.job, key))
        self.log.extend(events)

    def span(self, task: str, device: str, phase: str, step: int, start: float, end: float, examples: int = 0,
             key: str = "") -> None:
        """One measured phase of one step (sync-ps: a worker's gradient, an apply on the ps)."""
        if self.log is not None:
            self.log.append(StepSpan(task, device, phase, self._local(task, start), self._local(task, end), step, 1,
                                     examples, self.job, key))

    def step_done(self, record: dict) -> None:
        """A record of ``job.history``: a step that counts, for total throughput and progress.

        History keeps the worker's own clock; the event is on the kernel's (first worker's offset).
        """
        if self.log is not None:
            workers = tuple(record["worker"].split(","))
            self.log.append(StepDone(self.job, record["step"], self._local(workers[0], record["start"]),
                                     self._local(workers[0], record["end"]), record["examples"], workers,
                                     record["loss"]))

    def progress(self, steps_done: int, steps_total: int, state: str, started: float, strategy: str,
                 workers: Sequence[str], transfer: str = "", bytes_per_step: int = 0) -> None:
        if self.log is not None:
            self.log.append(JobProgress(self.job, time.time(), steps_done, steps_total, state, started, strategy,
                                        tuple(workers), transfer, bytes_per_step))
