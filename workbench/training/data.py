"""Per-worker input: the user's ``data(ctx)`` function, batched and sharded identically everywhere.

``data(ctx)`` returns a ``tf.data.Dataset`` of *unbatched* ``(features, labels)`` examples in a
deterministic order (shuffle with ``seed=ctx.seed``). The workbench repeats it, batches it with
the per-worker batch, and gives worker ``w`` batches ``w, w+N, w+2N, ...``: one synchronous step
over N workers then sees exactly the global batch a single worker would see, so sync strategies
follow the same loss curve whatever the number of workers.

tf.data's autotuning is off in these pipelines unless the dataset's own options set
``autotune.enabled``: its model thread sleeps between rounds of tuning without waking when the
pipeline goes, and the deletion of a job's iterator on a worker waited for it, up to about a
second, holding the worker's queue of remote operations, so the next job's first call there
waited too. Pipelines that tune (``num_parallel_calls=tf.data.AUTOTUNE``) keep it by setting the
option themselves; without it, an ``AUTOTUNE`` parallelism is tf.data's fixed default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DataContext:
    """What a data function may want to know about the pipeline it feeds."""

    worker_index: int
    num_workers: int
    per_worker_batch_size: int
    seed: int
    training: bool = True


def training_dataset(data: Callable[[DataContext], Any], ctx: DataContext):
    """The endless, batched, sharded dataset of one worker (built where it is traced and run)."""
    dataset = data(ctx)
    _check_dataset(dataset, data)
    dataset = dataset.repeat().batch(ctx.per_worker_batch_size, drop_remainder=True)
    if ctx.num_workers > 1:
        dataset = dataset.shard(ctx.num_workers, ctx.worker_index)
    return _quick_to_delete(dataset.prefetch(2))


def validation_dataset(data: Callable[[DataContext], Any], ctx: DataContext, steps: int | None = None):
    """Worker ``ctx.worker_index``'s share of a validation pass: batches ``w, w+N, ...`` of one pass of the
    data; with ``steps``, of its first ``steps`` global batches (N per-worker batches each) only."""
    dataset = data(ctx)
    _check_dataset(dataset, data)
    dataset = dataset.batch(ctx.per_worker_batch_size)
    if ctx.num_workers > 1:
        dataset = dataset.shard(ctx.num_workers, ctx.worker_index)
    if steps is not None:
        dataset = dataset.take(steps)
    return _quick_to_delete(dataset)


def _quick_to_delete(dataset):
    """``dataset`` without tf.data's autotuning, unless its options say otherwise (see the module's docstring)."""
    import tensorflow as tf

    from ..compat import tensorflow as tf_compat

    if tf_compat.dataset_options(dataset).autotune.enabled is not None:
        return dataset
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def evaluation_dataset(data: Callable[[DataContext], Any], batch_size: int, seed: int):
    """One pass of ``data``, batched, on one worker (``job.evaluate``)."""
    return validation_dataset(data, DataContext(0, 1, batch_size, seed, training=False))


def _check_dataset(dataset: Any, data: Callable) -> None:
    import tensorflow as tf

    from ..errors import ConfigurationError

    if not isinstance(dataset, tf.data.Dataset):
        raise ConfigurationError(
            f"the data function {getattr(data, '__name__', data)!r} returned {type(dataset).__name__}, not a "
            "tf.data.Dataset: return tf.data.Dataset.from_tensor_slices((x, y)) or another unbatched pipeline."
        )
    spec = dataset.element_spec
    if not (isinstance(spec, tuple) and len(spec) == 2):
        raise ConfigurationError(
            "the data function must yield (features, labels) pairs, one example each (unbatched); "
            f"its elements are {spec}."
        )


def batch_spec(data: Callable, ctx: DataContext) -> tuple[Any, Any]:
    """The ``(features, labels)`` ``tf.TensorSpec``s of the batches ``data`` yields for ``ctx``."""
    return training_dataset(data, ctx).element_spec


def example_spec(data: Callable, ctx: DataContext) -> tuple[list, Any]:
    """The shape (a batch of one) and dtype of the features ``data`` yields for ``ctx``: what a model is built on."""
    return features_of(batch_spec(data, ctx))


def features_of(batch: tuple[Any, Any]) -> tuple[list, Any]:
    """The shape (a batch of one) and dtype of the features of a ``batch_spec``."""
    spec = batch[0]
    return [1, *spec.shape[1:]], spec.dtype
