"""The options of ``wb.train``, declared and validated once (pure: no TensorFlow)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigurationError

STRATEGIES = ("async-ps", "sync-ps", "allreduce", "model-parallel")
POLICIES = ("wait", "drop", "replace")  # what a job does about a hung task or a straggling call
ELASTIC_BATCHES = ("per-worker", "global")  # what a job keeps when the cluster is scaled while it trains
TRANSFERS = ("fp32", "bf16", "fp16", "int8")  # precision of parameters and gradients between ps and workers


def overlap_transfers() -> bool:
    """async-ps reads the next step's parameters while a step computes and pushes, unless
    ``WORKBENCH_OVERLAP_TRANSFERS=0`` (read when a job builds its steps)."""
    return os.environ.get("WORKBENCH_OVERLAP_TRANSFERS", "1") != "0"


@dataclass(frozen=True)
class TrainOptions:
    """What to train and how; see ``wb.train`` for the meaning of each field."""

    strategy: str = "async-ps"
    steps: int = 1000
    batch_size: int = 64  # global: split evenly over the workers
    backup_workers: int = 0  # sync-ps only
    steps_per_call: int = 10  # steps a worker runs per remote call (every strategy)
    metrics: tuple = ()
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # steps; 0: only at the end (if checkpoint_dir)
    resume: bool = False
    seed: int | None = None
    step_timeout: float = 300.0  # seconds a sync step may wait for its gradients
    partition_bytes: int = 16 * 2**20  # ps strategies: split variables this large over the ps tasks
    telemetry: bool = True  # step spans and throughput for the dashboards (cluster.telemetry)
    recover: bool = True  # re-host lost tasks and go on (a ps: from the newest checkpoint); False: fail fast
    hang_timeout: float = 30.0  # seconds a task may answer nothing before on_hang applies
    on_hang: str | None = None  # wait | drop | replace; None: replace if recover, else wait
    straggler_factor: float = 10.0  # a call this many times its peers' median (and >= 1 s) straggles
    on_straggler: str = "wait"  # wait | drop | replace
    transfer: str = "fp32"  # ps strategies: fp32 | bf16 | fp16 | int8 on the wire
    elastic_batch: str = "per-worker"  # after cluster.scale mid-job: keep the per-worker batch, or the "global" one
    num_workers: int = field(default=1)
    epochs: int = 1  # steps = epochs x steps_per_epoch (``resolve_epochs``)
    steps_per_epoch: int | None = None  # None: one epoch of ``steps``
    validation_steps: int | None = None  # batches per validation (None: one pass of the validation data)
    validation_freq: int = 1  # validate after every this many epochs

    @property
    def epoch_steps(self) -> int:
        return self.steps_per_epoch or self.steps

    @property
    def hang_policy(self) -> str:
        return self.on_hang or ("replace" if self.recover else "wait")

    @property
    def per_worker_batch(self) -> int:
        return self.batch_size // self.num_workers

    @property
    def required_gradients(self) -> int:
        """sync-ps: gradients aggregated per step (the first N - k to arrive)."""
        return self.num_workers - self.backup_workers


def resolve_epochs(steps: int | None, epochs: int | None, steps_per_epoch: int | None,
                   examples_per_epoch: int | None = None, batch_size: int = 1) -> tuple[int, int, int]:
    """``(steps, epochs, steps_per_epoch)`` from what the user passed, with Keras's meaning of each.

    ``steps`` is the total; ``epochs`` defaults to 1; without ``steps_per_epoch`` an epoch is one pass of
    the training data (``examples_per_epoch`` // ``batch_size``, when the data says how long it is).
    """
    for name, value in (("steps", steps), ("epochs", epochs), ("steps_per_epoch", steps_per_epoch)):
        if value is not None:
            _whole(name, value, 1)
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


def _whole(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{name}={value!r} is not allowed: pass a whole number >= {minimum}.")
    return value


def validate(options: TrainOptions) -> TrainOptions:
    """Check every field against the others; raise ``ConfigurationError`` saying what to change."""
    if options.strategy not in STRATEGIES:
        raise ConfigurationError(f"strategy={options.strategy!r} is not known: use one of {', '.join(STRATEGIES)}.")
    n = _whole("workers", options.num_workers, 1)
    _whole("steps", options.steps, 1)
    _whole("batch_size", options.batch_size, 1)
    _whole("steps_per_call", options.steps_per_call, 1)
    _validate_epochs(options)
    _whole("checkpoint_every", options.checkpoint_every, 0)
    _whole("partition_bytes", options.partition_bytes, 0)
    k = _whole("backup_workers", options.backup_workers, 0)
    if options.batch_size % n:
        raise ConfigurationError(
            f"batch_size={options.batch_size} (the global batch) does not split evenly over {n} workers: "
            f"use a multiple of {n}, e.g. batch_size={max(n, options.batch_size // n * n)}."
        )
    if k and options.strategy != "sync-ps":
        raise ConfigurationError(
            f"backup_workers={k} only applies to strategy='sync-ps' (it drops the slowest gradients of each "
            f"synchronous step); with strategy={options.strategy!r} leave it at 0."
        )
    if k >= n:
        raise ConfigurationError(
            f"backup_workers={k} leaves no gradient to aggregate with {n} worker(s): use at most {n - 1}, "
            "or scale the cluster up."
        )
    if options.checkpoint_every and not options.checkpoint_dir:
        raise ConfigurationError("checkpoint_every needs checkpoint_dir: pass the directory to write checkpoints to.")
    if options.resume and not options.checkpoint_dir:
        raise ConfigurationError("resume=True needs checkpoint_dir: the directory holding the checkpoints to resume from.")
    if options.resume and not any(Path(options.checkpoint_dir).glob("ckpt-*.index")):
        raise ConfigurationError(
            f"resume=True but {options.checkpoint_dir!r} holds no checkpoint: train without resume first, or "
            "point checkpoint_dir at the directory of the run to continue."
        )
    if not isinstance(options.step_timeout, (int, float)) or options.step_timeout <= 0:
        raise ConfigurationError(f"step_timeout={options.step_timeout!r} must be a positive number of seconds.")
    _validate_fault_handling(options)
    if options.elastic_batch not in ELASTIC_BATCHES:
        raise ConfigurationError(f"elastic_batch={options.elastic_batch!r}: use 'per-worker' (each worker's batch stays "
                                 "as it is when the cluster is scaled mid-job) or 'global' (batch_size stays).")
    if options.transfer not in TRANSFERS:
        raise ConfigurationError(f"transfer={options.transfer!r} is not a precision: use one of "
                                 f"{', '.join(map(repr, TRANSFERS))}.")
    if options.transfer != "fp32" and options.strategy not in ("async-ps", "sync-ps"):
        raise ConfigurationError(
            f"transfer={options.transfer!r} sets how parameters and gradients travel between ps and workers; "
            f"strategy={options.strategy!r} has no such transfers: use strategy='async-ps' or 'sync-ps', or "
            "leave transfer='fp32'.")
    return options


def _validate_epochs(options: TrainOptions) -> None:
    _whole("epochs", options.epochs, 1)
    _whole("validation_freq", options.validation_freq, 1)
    if options.validation_steps is not None:
        _whole("validation_steps", options.validation_steps, 1)
    if options.steps_per_epoch is not None and options.steps_per_epoch * options.epochs != options.steps:
        raise ConfigurationError(f"steps={options.steps} must be epochs={options.epochs} x "
                                 f"steps_per_epoch={options.steps_per_epoch}.")


def _validate_fault_handling(options: TrainOptions) -> None:
    if not isinstance(options.recover, bool):
        raise ConfigurationError(f"recover={options.recover!r}: pass True (re-host lost tasks and go on) or False (fail fast).")
    for name in ("hang_timeout", "straggler_factor"):
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigurationError(f"{name}={value!r} must be a positive number.")
    if options.straggler_factor < 1.5:
        raise ConfigurationError(f"straggler_factor={options.straggler_factor!r} would flag ordinary calls: use 1.5 or more "
                                 "(the default 10 flags a call ten times its peers' median).")
    for name in ("on_hang", "on_straggler"):
        value = getattr(options, name)
        if name == "on_hang" and value is None:
            continue
        if value not in POLICIES:
            raise ConfigurationError(f"{name}={value!r} is not a policy: use one of {', '.join(map(repr, POLICIES))}.")
        if value == "replace" and not options.recover:
            raise ConfigurationError(f"{name}='replace' re-hosts the task, and recover=False forbids that: pass recover=True "
                                     "or another policy ('wait', 'drop').")
        if value == "drop" and options.strategy in ("allreduce", "model-parallel"):
            raise ConfigurationError(
                f"{name}='drop': strategy={options.strategy!r} needs every worker in every step, so none can be left out; "
                "use 'wait' or 'replace'.")
