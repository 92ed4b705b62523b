"""Validation at an epoch's end of a ps or placed job: a data function on every worker at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ....cluster.health import RUNNING as RUNNING_TASK
from ....errors import TrainingError
from ...data import DataContext, validation_dataset
from ...fit.evaluation import combine_parts
from ...job.recovery import classify, is_infrastructure_error
from ...job.workers import own_executor


def validate_on_workers(job, trainer, data: Callable, steps: int | None) -> dict[str, float]:
    """A validation pass of a data function on a ps or placed job's workers at once, each its share of the
    batches (``data.validation_dataset``), on the variables where they live (``trainer``: the job's
    ``PsTrainer``); combined by examples.

    It runs on the workers that are up and that the job has taken back (a re-hosted one is running before the job's
    connection knows it again). A worker lost during the pass is left out and the pass run again on the others.
    """
    supervisor = job.supervisor
    up = [i for i, r in enumerate(job.workers) if job.cluster.task(r.name).state == RUNNING_TASK
          and not (supervisor is not None and supervisor.rehosting(r.name))] or [0]
    while True:
        parts = _shares(job, trainer, data, steps, up)
        lost = [i for i in up if isinstance(parts[i], Exception) and is_infrastructure_error(parts[i])]
        if not lost or len(lost) == len(up):
            break
        up = [i for i in up if i not in lost]  # fewer each time: at most one pass per worker
    for index in up:
        if isinstance(parts[index], Exception):
            raise classify(job, parts[index], f"{job.workers[index].name} (validating)")
    return combine_parts([parts[i] for i in up], job.metric_names)


def _shares(job, trainer, data: Callable, steps: int | None, up: list[int]) -> dict[int, tuple | Exception]:
    """Each of workers ``up`` validates its share at once: ``(values, examples)``, or the error it raised."""
    import tensorflow as tf

    parts: dict[int, tuple | Exception] = {}

    @own_executor
    def share(position: int, index: int) -> None:
        device = trainer.worker_devices[index]
        ctx = DataContext(position, len(up), job.options.per_worker_batch, trainer.seed, training=False)
        function = trainer.fns.validation_on((device, position, len(up)), tf.autograph.experimental.do_not_convert(
            lambda: validation_dataset(data, ctx, steps)))
        try:
            with tf.device(device):
                values, count = function()
            parts[index] = (values.numpy().tolist(), int(count.numpy()))
        except Exception as exc:  # noqa: BLE001 - classified by the caller, in the job's thread
            parts[index] = exc

    threads = [threading.Thread(target=share, args=(p, i), daemon=True, name=f"workbench-validate-{i}")
               for p, i in enumerate(up)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + job.options.recovery.step_timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    for index in up:
        if index not in parts:
            raise TrainingError(f"validation on {job.workers[index].name} did not finish within step_timeout="
                                f"{job.options.recovery.step_timeout:.0f} s: "
                                "lower validation_steps, or raise wb.Recovery(step_timeout=...).")
    return parts
