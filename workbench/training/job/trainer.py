"""The one protocol every strategy implements: ``Trainer``, what a strategy does for the job that holds it.

A ``Job`` is the same for every strategy (its queue turn, thread, states, records, checkpoint cadence,
faults, waiting and stopping); it holds one trainer, made by its strategy (``strategies.TRAINERS``), and
asks it for everything that depends on how the workers train together. The trainer reads the job's
public side: ``job.options``, ``job.cluster``, ``job.inputs``, ``job.workers`` and the parts a run
uses (``job.lock``, ``job.loop``, ``job.recorder``, ``job.supervisor``), and hands every call's steps to
``job.record_call``, which records them and saves a checkpoint when one is due.

Who calls what, in a job's life: ``set_up`` once its turn comes (its thread), then ``run`` until the steps
are done; ``save`` whenever a checkpoint is due; after a task it cannot go on without was lost and
re-hosted, ``restore`` then ``run`` again; after a scale it follows, ``follow_scale`` then ``run``; at the
end ``release``. From the notebook: ``check_rescale`` (``cluster.scale``), ``evaluate``, ``local_model``
(``job.model``), ``info``. From the epoch loop: ``callback_model`` and ``validate``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class JobInputs:
    """What ``wb.train`` was given to build the job from, as given (a trainer builds from them when set up)."""

    model: Any  # make_model(), a Keras model, or a placed model (wb.place)
    data: Any  # data(ctx) -> tf.data.Dataset
    loss: Any  # a Keras loss (name, object or function)
    optimizer: Any  # a Keras optimizer (name, object or function)


class HeldByJob:
    """A trainer's link to the job that holds it: weak, so that the two form no cycle (an ended job nobody holds is
    freed at once, with what it holds in TensorFlow, rather than by the garbage collector in a later job)."""

    def __init__(self, job):
        self._job = weakref.ref(job)

    @property
    def job(self):
        return self._job()

    @property
    def options(self):
        """The job's options (they change when the job follows a scale)."""
        return self._job().options


class Trainer(Protocol):
    """What a strategy does for its job. Each strategy's trainer lives in ``strategies/`` and is registered in
    ``strategies.TRAINERS``; its constructor takes the job and touches no task (a queued job waits its turn)."""

    holders: str  # what the tasks are whose loss needs a restore, in messages ("parameter server")
    uses_connection: bool  # runs ops through this kernel's TensorFlow connection (all-reduce runs on the engines only)
    restore_tasks: list[str]  # the tasks whose loss ends a run with a restore (the ps tasks; none for all-reduce)

    def set_up(self) -> None:
        """The job's turn came (in its thread): build the model's variables and the input pipelines on the tasks;
        with ``options.resume``, restore the newest checkpoint and set ``job.start_step`` and ``job.last_checkpoint``."""

    def run(self) -> None:
        """Run the job's missing steps (``job.missing_steps()``), each call's records into ``job.record_call``,
        until they are done, the loop finished or the job was stopped. Raises ``TaskLost`` (a task it cannot go on
        without) or ``WorkersChanged`` (a scale to follow, drained at a step boundary)."""

    def save(self, step: int) -> str:
        """Write a checkpoint of the variables as they are at ``step``; return its path."""

    def restore(self, checkpoint: str | None, step: int) -> None:
        """The lost tasks are back on new engines: build the variables again and restore ``checkpoint`` (None: the
        initial weights), which holds ``step``."""

    def check_rescale(self, workers: int) -> None:
        """Raise (``ClusterStateError``, ``ConfigurationError``) if the job cannot follow a scale to ``workers``."""

    def follow_scale(self, requests: list, drained: float) -> None:
        """At a step boundary (no call in flight): train on the cluster's workers from now on, less those leaving."""

    def evaluate(self, data: Any, batch_size: int) -> dict[str, float]:
        """One pass of the data function ``data(ctx)`` on the trained variables, on ``worker:0``."""

    def validate(self, data: Any, steps: int | None) -> dict[str, float]:
        """Validation at an epoch's end (a data function on the workers, or a dataset in this kernel)."""

    def callback_model(self) -> tuple[Any, Any]:
        """The Keras callbacks' model, and what keeps it in step with the tasks (None when its variables live there)."""

    def model_on_tasks(self) -> Any:
        """The Keras model whose variables live on the cluster's tasks (``wb.placement(job)``); None where every
        worker holds a copy (all-reduce)."""

    def local_model(self) -> Any:
        """A Keras model in this kernel holding the trained weights (``job.model``)."""

    def example_rank(self) -> int:
        """The rank of one example's features (to tell a batched dataset from one of single examples)."""

    def bytes_per_step(self) -> dict | None:
        """What one step of one worker moves between it and the ps tasks; None where no ps is involved."""

    def info(self) -> dict:
        """What ``job.info`` adds for this strategy (replicas, layers' tasks...)."""

    def release(self) -> None:
        """The job ended (its thread): let go of what only training needed, keep what ``evaluate`` and ``model`` use."""

    def release_remote(self) -> None:
        """The kernel connects elsewhere: keep the trained weights here (``local_model``), drop what lived on the tasks."""

    def free_engines(self) -> None:
        """Ask the engines to let go of what the job left there (no waiting; an optimisation)."""
