"""Validation at an epoch's end of a ps or placed job: a data function on every worker at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ....cluster.health import RUNNING as RUNNING_TASK
from ....errors import TrainingError
from ...data import DataContext, validation_dataset
from ...fit.evaluation import combine_parts
from ...job.recovery import classify
from ...job.workers import own_executor


def validate_on_workers(job, trainer, data: Callable, steps: int | None) -> dict[str, float]:
    """A validation pass of a data function on a ps or placed job's workers at once, each its share of the
    batches (``data.validation_dataset``), on the variables where they live (``trainer``: the job's
    ``PsTrainer``); combined by examples."""
    import tensorflow as tf

    up = [i for i, r in enumerate(job.workers) if job.cluster.task(r.name).state == RUNNING_TASK] or [0]
    parts: dict[int, tuple] = {}

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
        except Exception as exc:  # noqa: BLE001 - classified below, in the job's thread
            parts[index] = exc

    threads = [threading.Thread(target=share, args=(p, i), daemon=True, name=f"workbench-validate-{i}")
               for p, i in enumerate(up)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + job.options.recovery.step_timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    for index in up:
        part = parts.get(index)
        name = job.workers[index].name
        if part is None:
            raise TrainingError(f"validation on {name} did not finish within step_timeout="
                                f"{job.options.recovery.step_timeout:.0f} s: "
                                "lower validation_steps, or raise wb.Recovery(step_timeout=...).")
        if isinstance(part, Exception):
            raise classify(job, part, f"{name} (validating)")
    return combine_parts([parts[i] for i in up], job.metric_names)
