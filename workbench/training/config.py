"""What ``wb.train`` is told, in objects that say what they are for (pure: no TensorFlow).

* a **strategy** (``wb.AsyncPS``, ``wb.SyncPS``, ``wb.AllReduce``, ``wb.ModelParallel``) carries the
  options that mean something for it alone: a sync-ps job's backup workers, a ps job's transfer
  precision. A combination that makes no sense cannot be written: ``wb.AllReduce(transfer="bf16")``
  is a ``TypeError`` at once. The string names (``strategy="sync-ps"``) give each one's defaults.
* ``wb.Recovery`` says what a job does when a task is lost, hangs or straggles, and how long it waits;
* ``wb.Checkpoint`` says where and how often a job saves, and whether it resumes.

Each object checks its own fields when it is made; what depends on the cluster (a sync-ps job's
backup workers against its workers) is checked by ``wb.train``. This module is the strategy
registry: nowhere else in the workbench is a strategy told apart by its name.
"""

from __future__ import annotations

import functools
import os
from dataclasses import KW_ONLY, dataclass, fields
from typing import ClassVar

from ..errors import ConfigurationError

POLICIES = ("wait", "drop", "replace")  # what a job does about a hung task or a straggling call
ELASTIC_BATCHES = ("per-worker", "global")  # what a job keeps when the cluster is scaled while it trains
TRANSFERS = ("fp32", "bf16", "fp16", "int8")  # precision of parameters and gradients between ps and workers


def whole(name: str, value: object, minimum: int) -> int:
    """``value`` if it is a whole number >= ``minimum``, else a ``ConfigurationError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{name}={value!r} is not allowed: pass a whole number >= {minimum}.")
    return value


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigurationError(f"{name}={value!r} must be a positive number.")
    return value


def _explained(cls: type) -> type:
    """Make a dataclass's ``TypeError`` for an option it lacks, or one passed by position, say what to write instead
    (which object has that option: ``wb.AllReduce(transfer=...)`` names ``wb.AsyncPS`` and ``wb.SyncPS``)."""
    init = cls.__init__
    positional = [f.name for f in fields(cls) if not f.kw_only]

    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        options = [f.name for f in fields(cls)]
        if len(args) > len(positional):
            named = ", ".join(f"{n}=..." for n in options[len(positional):])
            raise TypeError(f"wb.{cls.__name__} takes its options by name: wb.{cls.__name__}({', '.join(positional)}"
                            f"{', ' if positional else ''}{named}).")
        for name in kwargs:
            if name not in options:
                takers = [f"wb.{k.__name__}" for k in (*STRATEGIES.values(), Recovery, Checkpoint)
                          if name in {f.name for f in fields(k)}]
                where = f": it is an option of {' and '.join(takers)}" if takers else ""
                raise TypeError(f"wb.{cls.__name__} has no option {name}={where}. Its options: {', '.join(options)}.")
        init(self, *args, **kwargs)

    cls.__init__ = checked
    return cls


# -- strategies ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """What every strategy says about itself; the subclasses are the strategies users pick.

    ``steps_per_call``: the steps a worker runs per remote call (fewer round trips; also how many steps
    a worker lost mid-call may have to run again elsewhere).
    """

    name: ClassVar[str]
    transfer: ClassVar[str] = "fp32"  # how parameters and gradients travel: as stored, unless a ps strategy says
    backup_workers: ClassVar[int] = 0  # gradients a step may go without (sync-ps)
    data_parallel: ClassVar[bool] = True  # every worker of the cluster trains a replica on its share of the data
    synchronous: ClassVar[bool] = False  # every step waits for the workers' gradients (one global step per batch)
    leaves_workers_out: ClassVar[bool] = True  # a hung or straggling worker may be left out (policy "drop")
    variables_on_ps: ClassVar[bool] = False  # the variables live on the ps tasks, steps are driven from the kernel
    epoch_scalars: ClassVar[tuple[str, ...]] = ()  # what TensorBoard shows per worker each epoch, beyond its rates

    steps_per_call: int = 10

    def __post_init__(self) -> None:
        whole("steps_per_call", self.steps_per_call, 1)

    def check_workers(self, workers: int, batch_size: int) -> None:
        """Raise ``ConfigurationError`` if this strategy cannot train with ``workers`` workers on ``batch_size``."""

    def gradients_per_step(self, workers: int) -> int | None:
        """The gradients a synchronous step aggregates (None: the strategy has no such step)."""
        return None

    def spelled(self) -> str:
        """How to write this object (in messages): ``wb.SyncPS(backup_workers=1)``."""
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                   if getattr(self, f.name) != f.default]
        return f"wb.{type(self).__name__}({', '.join(changed)})"


@dataclass(frozen=True, kw_only=True)
class _ParameterServer(Strategy):
    """The options of both ps strategies (variables on the ps tasks, each worker's steps driven from the kernel).

    ``transfer``: the precision parameters (ps to worker) and gradients (worker to ps) travel in: ``"fp32"``
    (as stored), ``"bf16"`` or ``"fp16"`` (half the bytes), ``"int8"`` (a quarter; each variable scaled by
    its largest magnitude, and what rounding loses of a gradient kept on its worker and added to the next
    one). Values are restored on arrival; variables and updates stay in their own precision.
    ``job.info["bytes_per_step"]`` says what a step moves.

    ``partition_bytes``: a variable this large or larger (a big embedding) is split along its first axis over
    the ps tasks, each shard updated on its own ps; 0 never splits (``job.info["partitioned"]``).

    ``elastic_batch``: the job follows ``cluster.scale(workers=N)`` while it trains (at the next step boundary;
    ``job.events`` records each change). ``"per-worker"`` keeps each worker's batch, so the global batch
    follows the number of workers; ``"global"`` keeps ``batch_size`` and splits it over the new number
    (a scale to a number it does not divide by is refused). Either way every worker's input pipeline is
    made again with its new index and count.
    """

    variables_on_ps: ClassVar[bool] = True

    transfer: str = "fp32"
    partition_bytes: int = 16 * 2**20
    elastic_batch: str = "per-worker"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.transfer not in TRANSFERS:
            raise ConfigurationError(f"transfer={self.transfer!r} is not a precision: use one of "
                                     f"{', '.join(map(repr, TRANSFERS))}.")
        whole("partition_bytes", self.partition_bytes, 0)
        if self.elastic_batch not in ELASTIC_BATCHES:
            raise ConfigurationError(f"elastic_batch={self.elastic_batch!r}: use 'per-worker' (each worker's batch stays "
                                     "as it is when the cluster is scaled mid-job) or 'global' (batch_size stays).")

    def check_workers(self, workers: int, batch_size: int) -> None:
        if self.elastic_batch == "global" and batch_size % workers:
            raise ConfigurationError(
                f"the global batch_size={batch_size} (elastic_batch='global') does not split evenly over {workers} "
                "workers: scale to a number of workers that divides it.")


@_explained
@dataclass(frozen=True, kw_only=True)
class AsyncPS(_ParameterServer):
    """Asynchronous parameter server: each worker applies its own updates on the ps tasks as it computes them.

    Steps go out in chunks of ``steps_per_call``; a worker claims the next chunk when its call returns, so
    fast workers run more of them, and a lost worker's chunk runs elsewhere.

    ``overlap``: ``False`` (the default) reads each step's parameters after the worker's own last update landed.
    ``True`` reads the next step's parameters while a step computes and pushes, so both directions of the
    worker's link work at once: more steps/s where the ps's link is the limit (a slow link, a large model), but
    each step misses the worker's own last update (one update staler), and the job needs more steps to reach an
    accuracy (``bench/time_to_accuracy.py``). Turn it on when ``wb.estimate`` or the dashboards say the link limits.
    ``transfer``, ``partition_bytes``, ``elastic_batch``, ``steps_per_call``: see ``wb.SyncPS``.
    """

    name: ClassVar[str] = "async-ps"
    epoch_scalars: ClassVar[tuple[str, ...]] = ("staleness",)  # others' updates landed while a step of its own ran

    overlap: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.overlap, bool):
            raise ConfigurationError(f"overlap={self.overlap!r}: pass True (read the next step's parameters while a "
                                     "step computes) or False (read them after the worker's last update).")


@_explained
@dataclass(frozen=True, kw_only=True)
class SyncPS(_ParameterServer):
    """Synchronous parameter server: each step averages the first N - ``backup_workers`` gradients to arrive
    and drops the late ones (a slow worker costs a step nothing).

    ``backup_workers``: gradients a step may go without (0: every worker's); fewer than the workers.
    ``transfer``, ``partition_bytes``, ``elastic_batch``, ``steps_per_call``: as for every ps strategy
    (``transfer="bf16"`` halves the bytes a step moves; see the ``wb.train`` guide).
    """

    name: ClassVar[str] = "sync-ps"
    synchronous: ClassVar[bool] = True
    epoch_scalars: ClassVar[tuple[str, ...]] = ("dropped_gradients",)  # steps a worker's gradient was not applied to

    backup_workers: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        whole("backup_workers", self.backup_workers, 0)

    def check_workers(self, workers: int, batch_size: int) -> None:
        if self.backup_workers >= workers:
            raise ConfigurationError(
                f"backup_workers={self.backup_workers} leaves no gradient to aggregate with {workers} worker(s): use at "
                f"most {workers - 1}, or keep at least {self.backup_workers + 1} workers.")
        super().check_workers(workers, batch_size)

    def gradients_per_step(self, workers: int) -> int:
        return workers - self.backup_workers


@_explained
@dataclass(frozen=True, kw_only=True)
class AllReduce(Strategy):
    """All-reduce (MultiWorkerMirroredStrategy on the worker engines): every step all-reduces every worker's
    gradient; no ps needed. ``model``, ``data`` and functions are sent to the engines by value. Every worker
    takes part in every step, so none can be left out, and the cluster cannot be scaled while it trains."""

    name: ClassVar[str] = "allreduce"
    synchronous: ClassVar[bool] = True
    leaves_workers_out: ClassVar[bool] = False


@_explained
@dataclass(frozen=True, kw_only=True)
class ModelParallel(Strategy):
    """Model parallelism: a placed model's (``wb.place``) layers train on the tasks they were placed on, one
    input pipeline feeding them in turn. The strategy of every placed model (the default for one)."""

    name: ClassVar[str] = "model-parallel"
    data_parallel: ClassVar[bool] = False
    leaves_workers_out: ClassVar[bool] = False


STRATEGIES: dict[str, type[Strategy]] = {s.name: s for s in (AsyncPS, SyncPS, AllReduce, ModelParallel)}


def strategy_from(value: object, placed: bool) -> Strategy:
    """The strategy object ``wb.train`` was given (an object, a name, or None: the default for the model)."""
    if value is None:
        return ModelParallel() if placed else AsyncPS()
    if isinstance(value, str):
        if value not in STRATEGIES:
            raise ConfigurationError(f"strategy={value!r} is not known: use one of {', '.join(STRATEGIES)}, or an "
                                     "object such as wb.SyncPS(backup_workers=1).")
        value = STRATEGIES[value]()
    if not isinstance(value, Strategy):
        raise ConfigurationError(f"strategy={value!r}: pass wb.AsyncPS(), wb.SyncPS(...), wb.AllReduce() or one of "
                                 f"the names {', '.join(map(repr, STRATEGIES))}.")
    if placed and not isinstance(value, ModelParallel):
        raise ConfigurationError(
            f"a placed model (wb.place) trains with its layers on their tasks, not with {value.spelled()}: "
            "call placed.train(data, loss, ...), or wb.train without strategy.")
    if isinstance(value, ModelParallel) and not placed:
        raise ConfigurationError(
            "wb.ModelParallel needs a placed model: placed = wb.place(make_model, {'layer': 'worker:0', ...}), "
            "then placed.train(data, loss, ...).")
    return value


def strategy_named(name: str, **options) -> Strategy:
    """The strategy ``name`` with ``options`` (flat, as ``%wb train`` takes them); an option it lacks is refused."""
    if name not in STRATEGIES:
        raise ConfigurationError(f"strategy {name!r} is not known: use one of {', '.join(STRATEGIES)}.")
    kind = STRATEGIES[name]
    lacking = sorted(set(options) - {f.name for f in fields(kind)})
    if lacking:
        takers = [n for n, k in STRATEGIES.items() if {f.name for f in fields(k)} >= set(lacking)]
        raise ConfigurationError(f"{', '.join(lacking)} does not apply to strategy {name!r}"
                                 + (f": it is an option of {' and '.join(map(repr, takers))}." if takers else "."))
    return kind(**options)


# -- failures and checkpoints --------------------------------------------------------------------


@_explained
@dataclass(frozen=True, kw_only=True)
class Recovery:
    """What a job does about a task lost, hung or straggling, and how long it waits (``recovery=`` of ``wb.train``).

    ``rehost``: a lost task (its engine killed, OOM, pre-empted) is re-hosted on a new engine at the same
    address, and the job takes it back: a lost worker's steps run on the others meanwhile; a lost ps is
    restored from the newest checkpoint (``job.recoveries``); all-reduce re-forms its group and resumes
    from the newest checkpoint. False fails fast (``wb.ParameterServerLost``; an async-ps worker's steps
    still move to the others). ``recovery=None`` is ``Recovery(rehost=False)``.

    ``step_timeout``: seconds a sync-ps step may wait for its gradients (then the job fails), or an async-ps
    or all-reduce call may run (an async-ps worker that stalls longer is given up on, its steps re-run
    elsewhere; all-reduce fails, as every worker waits for it).

    ``hang_timeout``, ``on_hang``: a task that answers nothing (not even the reaper's ping) for
    ``hang_timeout`` seconds is flagged (a ``wb.TaskFaultWarning``, the status table, panel and dashboard)
    and handled by ``on_hang``: ``"replace"`` (the default with ``rehost``: kill and re-host it), ``"drop"``
    (leave it out: its steps run elsewhere; in sync-ps it counts like a late backup gradient) or ``"wait"``
    (the default without ``rehost``; ``step_timeout`` still bounds every wait).

    ``straggler_factor``, ``on_straggler``: a call running ``straggler_factor`` times longer than its peers'
    median (and at least a second) is flagged and handled by ``on_straggler`` (same policies).
    """

    rehost: bool = True
    step_timeout: float = 300.0
    hang_timeout: float = 30.0
    on_hang: str | None = None
    straggler_factor: float = 10.0
    on_straggler: str = "wait"

    def __post_init__(self) -> None:
        if not isinstance(self.rehost, bool):
            raise ConfigurationError(f"rehost={self.rehost!r}: pass True (re-host lost tasks and go on) or False (fail fast).")
        for name in ("step_timeout", "hang_timeout", "straggler_factor"):
            _positive(name, getattr(self, name))
        if self.straggler_factor < 1.5:
            raise ConfigurationError(f"straggler_factor={self.straggler_factor!r} would flag ordinary calls: use 1.5 or more "
                                     "(the default 10 flags a call ten times its peers' median).")
        for name in ("on_hang", "on_straggler"):
            value = getattr(self, name)
            if value is None and name == "on_hang":
                continue
            if value not in POLICIES:
                raise ConfigurationError(f"{name}={value!r} is not a policy: use one of {', '.join(map(repr, POLICIES))}.")
            if value == "replace" and not self.rehost:
                raise ConfigurationError(f"{name}='replace' re-hosts the task, and rehost=False forbids that: pass "
                                         "rehost=True or another policy ('wait', 'drop').")

    @property
    def hang_policy(self) -> str:
        return self.on_hang or ("replace" if self.rehost else "wait")

    def check_strategy(self, strategy: Strategy) -> None:
        """A policy that leaves a worker out, for a strategy whose every step needs every worker, is refused."""
        for name in ("on_hang", "on_straggler"):
            if getattr(self, name) == "drop" and not strategy.leaves_workers_out:
                raise ConfigurationError(
                    f"{name}='drop': {strategy.spelled()} needs every worker in every step, so none can be left out; "
                    "use 'wait' or 'replace'.")


def recovery_from(value: object) -> Recovery:
    if value is None:
        return Recovery(rehost=False)
    if not isinstance(value, Recovery):
        raise ConfigurationError(f"recovery={value!r}: pass wb.Recovery(...) (hang_timeout=, on_hang=, ...), or None "
                                 "to fail fast.")
    return value


@_explained
@dataclass(frozen=True)
class Checkpoint:
    """Periodic ``tf.train.Checkpoint`` of model, optimizer and step (``checkpoint=`` of ``wb.train``).

    ``directory``: where (``ckpt-<step>``); ``every``: save each time this many more steps are done (in
    async-ps within ``steps_per_call`` x workers steps after each multiple; 0: only at the end, which is
    always saved); ``resume``: continue from the newest checkpoint there; ``keep``: how many to keep.
    ``checkpoint="dir"`` is ``Checkpoint("dir")``.
    """

    directory: str
    _: KW_ONLY
    every: int = 0
    resume: bool = False
    keep: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.directory, (str, os.PathLike)) or not str(self.directory):
            raise ConfigurationError(f"directory={self.directory!r}: pass the directory to write checkpoints to.")
        object.__setattr__(self, "directory", os.fspath(self.directory))
        whole("every", self.every, 0)
        whole("keep", self.keep, 1)
        if not isinstance(self.resume, bool):
            raise ConfigurationError(f"resume={self.resume!r}: pass True (continue from the newest checkpoint) or False.")


def checkpoint_from(value: object) -> Checkpoint | None:
    if value is None or isinstance(value, Checkpoint):
        return value
    if isinstance(value, (str, os.PathLike)):
        return Checkpoint(value)
    raise ConfigurationError(f"checkpoint={value!r}: pass a directory, or wb.Checkpoint(directory, every=..., "
                             "resume=..., keep=...).")
