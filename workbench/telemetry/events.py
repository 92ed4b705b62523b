"""The event records the dashboards are drawn from (pure dataclasses: no TensorFlow, no Bokeh).

Times are seconds since the epoch on the kernel's clock. Step times are measured on the worker
(``tf.timestamp()`` inside the step function) and shifted by that task's clock offset, so tasks
on other hosts line up with each other and with the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Phases of a training step, in the order they happen; a step span has one of them.
COMPUTE = "compute"  # forward and backward pass on the worker (sync-ps: and reading the parameters)
PUSH_APPLY = "push+apply"  # async-ps: gradients go to the ps tasks, are applied there, and the next parameters come back
ALLREDUCE_APPLY = "allreduce+apply"  # allreduce: gradients summed across workers, applied on each
APPLY = "apply"  # sync-ps, on a ps row: the aggregated gradients are averaged and applied
RUNNING = "running"  # in progress: a call on the worker that has not returned yet
PHASES = (COMPUTE, PUSH_APPLY, ALLREDUCE_APPLY, APPLY, RUNNING)


@dataclass(frozen=True)
class StepSpan:
    """A step, or one phase of it, on one device. ``end`` is None while it is still running.

    ``key`` identifies an in-progress span so that the span that completes it can replace it.
    """

    task: str  # "worker:0"
    device: str  # "/job:worker/replica:0/task:0/device:CPU:0"
    phase: str
    start: float
    end: float | None
    step: int  # the first step of the span (an in-progress call may cover several: see ``steps``)
    steps: int = 1
    examples: int = 0
    job: str = ""
    key: str = ""

    @property
    def duration(self) -> float | None:
        return None if self.end is None else self.end - self.start


@dataclass(frozen=True)
class StepDone:
    """A training step that counts: one per record of ``job.history`` (sync steps: once, when applied)."""

    job: str
    step: int
    start: float
    end: float
    examples: int
    workers: tuple[str, ...]
    loss: float = float("nan")


@dataclass(frozen=True)
class ThroughputSample:
    """Examples and steps per second over a window ending at ``time``, for one worker or ``"total"``."""

    time: float
    worker: str
    examples_per_s: float
    steps_per_s: float


@dataclass(frozen=True)
class JobProgress:
    """Where a job stands: emitted when it starts, as steps land, and when it ends."""

    job: str
    time: float
    steps_done: int
    steps_total: int
    state: str  # queued | running | stopping | finished | failed | cancelled (workbench.cluster.jobs)
    started: float
    strategy: str = ""
    workers: tuple[str, ...] = ()
    transfer: str = ""  # ps strategies: the precision parameters and gradients travel in
    bytes_per_step: int = 0  # what one worker's step moves between it and the ps tasks (0: not known)


@dataclass(frozen=True)
class TaskEvent:
    """A change in a task's health, or what a job did about it; the dashboards mark it on the task's row.

    ``kind`` is the task's new state (``silent``, ``lost``, ``recovering``, ``running`` when it is
    back), or a job's finding (``straggler``, ``dropped``, ``restored``: variables restored from a
    checkpoint). ``detail`` says why, in words.
    """

    task: str
    kind: str
    time: float
    detail: str = ""
    job: str = ""


@dataclass(frozen=True)
class LinkEvent:
    """The links between tasks were reshaped (``cluster.shape``); the timeline shades the time they held.

    ``shaping`` is what ``Cluster.network`` says of the rules now in force (``"unshaped"``: none).
    """

    time: float
    shaping: str


@dataclass(frozen=True)
class OpEvent:
    """One op (or other traced activity) from a profiler capture.

    ``row`` is the timeline row: the task's device plus the thread or stream it ran on. Send and
    Recv ops carry the rendezvous ``transfer_key`` that pairs them, and the devices it links.
    """

    task: str
    device: str
    row: str
    name: str
    op_type: str
    start: float
    end: float
    transfer_key: str = ""
    source_device: str = ""
    target_device: str = ""
    args: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def is_transfer(self) -> bool:
        return bool(self.transfer_key)
