"""``wb.estimate``: bytes and time per step on a given link, from a short measured profile.

The profile is a short job of the model on the cluster with unshaped links (synthetic data of the
model's input shape; what a step computes and how it is laid out are the job's own). It gives the
time a worker takes for one step when transfers cost nothing but CPU, and the bytes a step moves.
The link then adds its transfer times, in the shape of the strategy:

* async-ps: a worker step is ``compute + push + read`` (``max(compute + push, read)`` when reads
  overlap pushes, ``wb.AsyncPS(overlap=True)``), where a worker's call lays out ``UNROLL`` steps a pass and a step's
  push overlaps the next step's compute within a pass: a pass of U steps takes
  ``compute + (U - 1) max(compute, push) + push``; the workers' steps/s are capped by each direction of the ps's own
  link, which carries every worker's parameters out and gradients in. The two bounds do not simply
  take turns: where they are close, workers wait for each other's transfers on the shared card and
  the card idles while they compute, so a step takes their p-norm (``COMBINE``: p = 3), which is the
  larger bound where one clearly limits, and 2^(1/3) = 1.26 times it where both are equal.
* sync-ps: a step reads every worker's parameters through the ps's link, computes, then takes every
  worker's gradient back through it.

``Estimate.seconds_for(steps)`` adds the profile's set-up (from the training call to the first step's end, in a
kernel that trained before) to the steps at the predicted rate: the time a user waits for that many steps. How
many steps a strategy needs to reach an accuracy is not predicted (``bench/time_to_accuracy.py`` measures it).
Synthetic data has no input pipeline to make: given the job's own ``data`` and ``loss``, the profile trains on
them, and its set-up and rate include what the job's pipelines cost (a dataset's arrays sent to every worker,
its shuffling and batching).

Each task is one host with one network card of the link's rate (``cluster.shape`` emulates exactly
that). ``workers=`` extends the estimate to more workers than the cluster has: their compute is
assumed to scale (each on its own host), so only the ps's link is shared.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigurationError
from .config import Strategy, strategy_from
from .modelling.steps import UNROLL
from .moved import refusing_moved_arguments

PROFILE_STEPS = 200  # 120 left the workers' cycle to ~1 s of steps: 10 % apart between two profiles
# p of the norm that joins the workers' bound and the ps link's: fitted on one run of ``bench/network.py
# --part cost`` (2026-11-25: 8 points, 1 ps + 2 workers), checked on later ones (docs/benchmarks-history.md, Network)
COMBINE = 3.0
STEADY = (0.25, 0.9)  # the part of the profile's steps used (start-up and the last call left out)


@dataclass(frozen=True)
class Profile:
    """What ``wb.estimate`` measured: one short job on unshaped links."""

    strategy: Strategy  # wb.AsyncPS or wb.SyncPS, with the transfer precision measured
    batch_size: int  # global
    workers: int
    ps: int
    worker_step_seconds: float  # async-ps: one worker's mean cycle (a step and its share of the calls' gaps)
    global_step_seconds: float  # 1 / steps per second of the whole job
    parameter_bytes: int  # what one step reads from the ps tasks
    gradient_bytes: int  # what one step pushes to them
    overlap: bool
    setup_seconds: float = 0.0  # from the training call to the end of the job's first step (warm: not the kernel's first)
    steps_per_epoch: int | None = None  # the epochs the profile ran (their ends wait for every call: a rate sees them)
    own_data: bool = False  # trained on the job's data and loss (else synthetic data of the model's shapes)


@dataclass(frozen=True)
class Estimate:
    """A prediction of ``wb.estimate``; ``profile`` can be given again to predict other links or worker counts."""

    strategy: Strategy
    link_bits: float
    workers: int
    ps: int
    batch_size: int
    parameter_bytes: int
    gradient_bytes: int
    step_seconds: float  # global: one optimizer step of the job
    steps_per_s: float
    examples_per_s: float
    bottleneck: str
    profile: Profile

    def seconds_for(self, steps: int) -> float:
        """Wall-clock seconds from the training call to the end of ``steps`` global steps: the profile's set-up
        (connecting, tracing, the first call) and the steps at the predicted rate.

        The steps a job needs to reach an accuracy are the caller's to give (from a run in one process, say: the
        same global batch takes about as many steps synchronously; ``bench/time_to_accuracy.py`` shows how many
        more each strategy took): the estimate predicts how fast steps go, not how much each one teaches.
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigurationError(f"steps={steps!r}: pass a whole number of global steps >= 1.")
        return self.profile.setup_seconds + steps * self.step_seconds

    def __str__(self) -> str:
        from ..cluster.network.shaping import format_rate

        return (f"{self.strategy.name}, transfer {self.strategy.transfer}, {self.workers} worker(s) + {self.ps} ps on "
                f"{format_rate(self.link_bits)} links, global batch {self.batch_size}: "
                f"{(self.parameter_bytes + self.gradient_bytes) / 1e6:.2f} MB per step, "
                f"{self.steps_per_s:.1f} steps/s ({self.examples_per_s:,.0f} examples/s), limited by {self.bottleneck}"
                + (f"; a job's set-up {self.profile.setup_seconds:.1f} s (seconds_for(steps) adds it)"
                   if self.profile.setup_seconds > 0 else ""))

    __repr__ = __str__


def predict(profile: Profile, link_bits: float, workers: int | None = None) -> tuple[float, str]:
    """Global seconds per step, and what limits it, for ``profile`` on links of ``link_bits`` (pure)."""
    rate = link_bits / 8  # bytes per second, each direction of each task's card
    workers = workers or profile.workers
    per_ps = 1.0 / profile.ps  # variables spread evenly by size over the ps tasks
    read, push = profile.parameter_bytes / rate, profile.gradient_bytes / rate
    if profile.strategy.synchronous:
        fixed = profile.global_step_seconds  # compute, barrier and apply, measured unshaped
        through_ps = workers * per_ps * (read + push)
        return fixed + through_ps, ("the ps's link" if through_ps > fixed else "compute and coordination")
    compute = profile.worker_step_seconds
    pushed = (compute + (UNROLL - 1) * max(compute, push) + push) / UNROLL  # per step: compute, then its push
    worker = max(pushed, read) if profile.overlap else pushed + read
    candidates = {
        "the workers' steps": worker / workers,
        "the ps's link, outgoing": per_ps * read,
        "the ps's link, incoming": per_ps * push,
    }
    bottleneck = max(candidates, key=candidates.get)
    link = per_ps * max(read, push)  # each direction of the card is its own bound: the busier one counts
    return (candidates["the workers' steps"] ** COMBINE + link ** COMBINE) ** (1 / COMBINE), bottleneck


@refusing_moved_arguments("wb.estimate")
def estimate(model: Any, cluster, batch_size: int = 64, strategy: Any = "async-ps", link: Any = "1gbit", *,
             workers: int | None = None, profile: Profile | None = None, profile_steps: int = PROFILE_STEPS,
             steps_per_epoch: int | None = None, data: Any = None, loss: Any = None) -> Estimate:
    """Predict bytes and time per step of ``wb.train(cluster, model, ..., strategy=strategy)`` on ``link``.

    ``model``: as for ``wb.train`` (a function returning a Keras model). ``link``: a rate as
    ``cluster.shape`` takes it (``"1gbit"``, ``"10gbit"``). ``workers``: predict for this many workers
    (default: the cluster's). The first call runs a short profile job (``profile_steps`` steps,
    synthetic data, unshaped links: call ``cluster.shape(None)`` first); pass ``profile=`` (an earlier
    estimate's ``.profile``) to predict other links or worker counts without measuring again.
    ``steps_per_epoch``: the job's epochs, for the profile to run them too (an epoch's end waits for every
    call in flight, which a short epoch pays often). ``Estimate.seconds_for(steps)`` gives the time from the
    training call to the end of that many steps, set-up included.
    ``data``, ``loss``: the job's own data function and loss (as ``wb.train`` takes them), given together, for the
    profile to train on instead of synthetic data: its set-up then includes making the job's input pipelines, and
    its rate their cost per step, which ``seconds_for`` needs to predict a real job's time.
    Strategies: the ps ones, ``wb.AsyncPS(...)`` and ``wb.SyncPS(...)`` (or their names); a ``profile=`` serves
    the strategy it was measured with, options included.
    """
    from ..cluster.network.shaping import parse_rate

    strategy = strategy_from(strategy, placed=False)
    if not strategy.variables_on_ps:
        raise ConfigurationError(f"wb.estimate models the ps strategies (wb.AsyncPS, wb.SyncPS), not {strategy.spelled()}.")
    link_bits = parse_rate(link)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ConfigurationError(f"workers={workers!r}: pass a whole number of workers >= 1.")
    if steps_per_epoch is not None and (isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int)
                                        or steps_per_epoch < 1):
        raise ConfigurationError(f"steps_per_epoch={steps_per_epoch!r}: pass a whole number of steps >= 1, or "
                                 "leave it out (one epoch).")
    if (data is None) != (loss is None):
        raise ConfigurationError(f"{'loss' if loss is None else 'data'}= is missing: the profile trains on the job's own "
                                 "data with its loss, so pass both (or neither, for synthetic data).")
    if data is not None and not callable(data):
        raise ConfigurationError(f"data={data!r}: pass the job's data function, data(ctx) -> tf.data.Dataset, as "
                                 "wb.train takes it.")
    if profile is None:
        profile = measure_profile(model, cluster, batch_size, strategy, profile_steps, steps_per_epoch, data, loss)
    elif data is not None:
        raise ConfigurationError("data= and loss= are what a new profile trains on; profile= was measured already: "
                                 "leave them out, or leave profile= out to measure on them.")
    elif profile.strategy != strategy:  # transfer, overlap, steps a call: each changes what a step costs
        raise ConfigurationError(
            f"profile= was measured for {profile.strategy.spelled()}; this estimate asks for {strategy.spelled()}: "
            "measure again (leave profile= out).")
    elif steps_per_epoch is not None and steps_per_epoch != profile.steps_per_epoch:
        raise ConfigurationError(
            f"steps_per_epoch={steps_per_epoch}: profile= ran epochs of {profile.steps_per_epoch or 'all its'} steps, "
            "and the epochs shape the rate it measured: leave steps_per_epoch out, or measure again (leave profile= out).")
    n = workers or profile.workers
    step, bottleneck = predict(profile, link_bits, n)
    per_worker = profile.batch_size // profile.workers
    examples = per_worker * n if strategy.synchronous else per_worker  # what one global step trains on
    return Estimate(strategy, link_bits, n, profile.ps, per_worker * n, profile.parameter_bytes,
                    profile.gradient_bytes, step, 1 / step, examples / step, bottleneck, profile)


def measure_profile(model: Any, cluster, batch_size: int, strategy: Strategy, steps: int,
                    steps_per_epoch: int | None = None, data: Any = None, loss: Any = None) -> Profile:
    """Run the short profile job on ``cluster`` (unshaped links) and read its set-up, step times and bytes: on
    ``data`` with ``loss`` where given, else on synthetic data of the model's shapes.

    Where no job of this process finished on ``cluster`` yet, a warm-up job of one call per worker runs first, so
    that the set-up measured is that of a job in a kernel that has trained before (connected), as every job after
    the first is.
    """
    if cluster.shaped:
        raise ConfigurationError(
            f"cluster {cluster.name!r} has shaped links ({cluster.network}): the profile measures compute on "
            "unshaped ones. Call cluster.shape(None) first, or pass profile= from an earlier estimate.")
    own = data is not None
    if not own:
        shapes = _shapes(model)
        data, loss = (lambda ctx: _synthetic(shapes, ctx)), "mse"
    if not any(job.state == "finished" for job in cluster.jobs):  # the kernel's first job connects: not a job's set-up
        workers = sum(1 for task in cluster.tasks if task.job == "worker")
        _profile_job(model, data, loss, cluster, batch_size, strategy, strategy.steps_per_call * max(1, workers), None)
    job, called = _profile_job(model, data, loss, cluster, batch_size, strategy, steps, steps_per_epoch)
    history = sorted(job.history, key=lambda r: r["end"])
    steady = history[int(STEADY[0] * len(history)):int(STEADY[1] * len(history))]
    if len(steady) < 10:
        raise ConfigurationError(f"profile_steps={steps} leaves too few steady steps to time: use 100 or more.")
    rate = (len(steady) - 1) / (steady[-1]["end"] - steady[0]["end"])
    info = job.info
    per_step = statistics.median(r["end"] - r["start"] for r in steady)
    if not strategy.synchronous:  # async-ps: a worker's mean cycle: the gaps between its calls count too (the rate sees them)
        per_step = max(per_step, len(info["workers"]) / rate)
    moved = info["bytes_per_step"] or {"parameters": 0, "gradients": 0}
    overlap = bool(getattr(strategy, "overlap", False))  # wb.AsyncPS's; sync-ps reads after every update
    first = history[0]  # its end is on its worker's host clock: the kernel's, less that host's offset
    setup = first["end"] - cluster.clock_offsets().get(first["worker"], 0.0) - called
    return Profile(strategy, batch_size, len(info["workers"]), len(info["ps_bytes"]) or 1, per_step,
                   1 / rate, moved["parameters"], moved["gradients"], overlap, max(0.0, setup), steps_per_epoch, own)


def _profile_job(model: Any, data: Any, loss: Any, cluster, batch_size: int, strategy: Strategy, steps: int,
                 steps_per_epoch: int | None):
    """One finished job of ``model`` on ``data`` with ``loss``; and when it was called (the kernel's clock)."""
    from . import api

    length = ({"epochs": -(-steps // steps_per_epoch), "steps_per_epoch": steps_per_epoch} if steps_per_epoch
              else {"steps": steps})
    called = time.time()
    job = api.train(cluster, model, data, loss, "adam", strategy=strategy, metrics=(),
                    batch_size=batch_size, telemetry=False, seed=0, **length)
    try:
        job.wait(600)
    except TimeoutError:
        job.stop()
        raise ConfigurationError(f"the profile job of {steps} steps did not end within 600 s: it was stopped. "
                                 "Pass a smaller profile_steps.") from None
    if job.state != "finished":
        raise ConfigurationError(f"the profile job ended {job.state}: {job.error}")
    return job, called


def _shapes(model: Any) -> tuple[tuple, tuple]:
    """The shapes of one example's input and output (the model built here once, to look)."""
    import keras

    built = model() if callable(model) and not isinstance(model, keras.Model) else model
    inputs, outputs = getattr(built, "inputs", None), getattr(built, "outputs", None)
    if not inputs or not outputs or any(d is None for d in (*inputs[0].shape[1:], *outputs[0].shape[1:])):
        raise ConfigurationError("wb.estimate needs a model with known input and output shapes (start it with "
                                 "keras.Input(...)).")
    return tuple(int(d) for d in inputs[0].shape[1:]), tuple(int(d) for d in outputs[0].shape[1:])


def _synthetic(shapes: tuple[tuple, tuple], ctx):
    """Random inputs and zero targets of the model's shapes (a regression on its outputs): compute only."""
    import tensorflow as tf

    del ctx
    x, y = tf.random.stateless_normal(shapes[0], [0, 1]), tf.zeros(shapes[1])
    return tf.data.Dataset.from_tensors((x, y)).repeat()

