"""The options of ``wb.train``, declared and validated once (pure: no TensorFlow).

What a strategy, the fault handling and the checkpoints are told lives on their own objects
(``config.py``); ``TrainOptions`` holds them beside what every job has (steps, batches, metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigurationError
from .config import AsyncPS, Checkpoint, Recovery, Strategy, whole


@dataclass(frozen=True)
class TrainOptions:
    """What to train and how; see ``wb.train`` for the meaning of each field."""

    strategy: Strategy = field(default_factory=AsyncPS)
    recovery: Recovery = field(default_factory=Recovery)
    checkpoint: Checkpoint | None = None
    steps: int = 1000
    batch_size: int = 64  # global: split evenly over the workers
    metrics: tuple = ()
    seed: int | None = None
    telemetry: bool = True  # step spans and throughput for the dashboards (cluster.telemetry)
    num_workers: int = 1
    epochs: int = 1  # steps = epochs x steps_per_epoch (``resolve_epochs``)
    steps_per_epoch: int | None = None  # None: one epoch of ``steps``
    validation_steps: int | None = None  # batches per validation (None: one pass of the validation data)
    validation_freq: int = 1  # validate after every this many epochs

    @property
    def epoch_steps(self) -> int:
        return self.steps_per_epoch or self.steps

    @property
    def per_worker_batch(self) -> int:
        return self.batch_size // self.num_workers

    @property
    def required_gradients(self) -> int:
        """sync-ps: gradients aggregated per step (the first N - k to arrive)."""
        return self.num_workers - self.strategy.backup_workers

    @property
    def resume(self) -> bool:
        return self.checkpoint is not None and self.checkpoint.resume

    @property
    def checkpoint_every(self) -> int:
        return self.checkpoint.every if self.checkpoint is not None else 0


def resolve_epochs(steps: int | None, epochs: int | None, steps_per_epoch: int | None,
                   examples_per_epoch: int | None = None, batch_size: int = 1) -> tuple[int, int, int]:
    """``(steps, epochs, steps_per_epoch)`` from what the user passed, with Keras's meaning of each.

    ``steps`` is the total; ``epochs`` defaults to 1; without ``steps_per_epoch`` an epoch is one pass of
    the training data (``examples_per_epoch`` // ``batch_size``, when the data says how long it is).
    """
    for name, value in (("steps", steps), ("epochs", epochs), ("steps_per_epoch", steps_per_epoch)):
        if value is not None:
            whole(name, value, 1)
    if epochs is None and steps_per_epoch is None:
        total = 1000 if steps is None else steps
        return total, 1, total
    if epochs is None:
        if steps is None:
            return steps_per_epoch, 1, steps_per_epoch
        if steps % steps_per_epoch:
            raise ConfigurationError(f"steps={steps} is not a whole number of epochs of steps_per_epoch={steps_per_epoch}: "
                                     f"pass epochs= instead of steps (e.g. epochs={max(1, steps // steps_per_epoch)}).")
        return steps, steps // steps_per_epoch, steps_per_epoch
    if steps_per_epoch is not None:
        if steps is not None and steps != epochs * steps_per_epoch:
            raise ConfigurationError(f"steps={steps} contradicts epochs={epochs} x steps_per_epoch={steps_per_epoch}: "
                                     "pass epochs and steps_per_epoch, and leave steps out.")
        return epochs * steps_per_epoch, epochs, steps_per_epoch
    if steps is not None:
        if steps % epochs:
            raise ConfigurationError(f"steps={steps} does not split into epochs={epochs} equal epochs: pass "
                                     "steps_per_epoch= instead of steps.")
        return steps, epochs, steps // epochs
    if not examples_per_epoch:
        raise ConfigurationError(
            f"epochs={epochs} needs the length of an epoch, and the data function's dataset does not say how many "
            "examples it has (it repeats, or is filtered or generated): pass steps_per_epoch= (batches per epoch).")
    per_epoch = examples_per_epoch // batch_size
    if per_epoch < 1:
        raise ConfigurationError(f"the training data has {examples_per_epoch} examples, fewer than one batch of "
                                 f"batch_size={batch_size}: lower batch_size, or pass steps_per_epoch=.")
    return epochs * per_epoch, epochs, per_epoch


def validate(options: TrainOptions) -> TrainOptions:
    """Check every field against the others; raise ``ConfigurationError`` saying what to change."""
    n = whole("workers", options.num_workers, 1)
    whole("steps", options.steps, 1)
    whole("batch_size", options.batch_size, 1)
    _validate_epochs(options)
    if options.batch_size % n:
        raise ConfigurationError(
            f"batch_size={options.batch_size} (the global batch) does not split evenly over {n} workers: "
            f"use a multiple of {n}, e.g. batch_size={max(n, options.batch_size // n * n)}."
        )
    options.strategy.check_workers(n, options.batch_size)
    options.recovery.check_strategy(options.strategy)
    checkpoint = options.checkpoint
    if checkpoint is not None and checkpoint.resume and not any(Path(checkpoint.directory).glob("ckpt-*.index")):
        raise ConfigurationError(
            f"resume=True but {checkpoint.directory!r} holds no checkpoint: train without resume first, or "
            "point the checkpoint's directory at the run to continue."
        )
    return options


def _validate_epochs(options: TrainOptions) -> None:
    whole("epochs", options.epochs, 1)
    whole("validation_freq", options.validation_freq, 1)
    if options.validation_steps is not None:
        whole("validation_steps", options.validation_steps, 1)
    if options.steps_per_epoch is not None and options.steps_per_epoch * options.epochs != options.steps:
        raise ConfigurationError(f"steps={options.steps} must be epochs={options.epochs} x "
                                 f"steps_per_epoch={options.steps_per_epoch}.")
