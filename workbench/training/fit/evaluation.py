"""Evaluation and validation: ``job.evaluate(dataset)`` in the kernel, validation passes on the workers.

``job.evaluate(dataset)``: a ``tf.data.Dataset`` the user holds in the kernel, evaluated in the kernel.

A data *function* ``data(ctx)`` is evaluated where the job trains (it builds its pipeline there).
A dataset object lives in this process (its tensors, or a generator, are here), so it runs here,
on a local model holding the trained weights (``job.model``), batched or not as Keras users pass
it to ``model.evaluate``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...errors import ConfigurationError, first_line

_WHAT_TO_PASS = ("pass a tf.data.Dataset of (features, labels) pairs, batched or one example each, "
                 "or a data function data(ctx) like the one the job trains on")


def is_dataset(data: Any) -> bool:
    import tensorflow as tf

    return isinstance(data, tf.data.Dataset)


def check_validation_data(data: Any, steps: int | None) -> None:
    """``wb.train(validation_data=...)``: a data function, or a dataset that ends (or ``validation_steps``)."""
    import tensorflow as tf

    if data is None:
        if steps is not None:
            raise ConfigurationError(f"validation_steps={steps} needs validation_data: pass the data to validate on.")
        return
    if not callable(data) and not is_dataset(data):
        raise ConfigurationError(f"validation_data={type(data).__name__}: {_WHAT_TO_PASS}.")
    if is_dataset(data) and steps is None and int(data.cardinality()) == int(tf.data.INFINITE_CARDINALITY):
        raise ConfigurationError("validation_data repeats forever, so one validation pass never ends: pass "
                                 "validation_steps= (batches per validation), or drop its .repeat().")


def check_evaluation_data(data: Any) -> None:
    """Anything but a data function or a dataset gets an error saying what to pass."""
    if data is not None and not callable(data) and not is_dataset(data):
        raise ConfigurationError(f"job.evaluate({type(data).__name__}): {_WHAT_TO_PASS}.")


def named_results(values: list[float], metric_names, examples: int) -> dict[str, float]:
    """``{"loss": ..., <metric>: ..., "examples": n}`` from an evaluation's values (the loss first, then the metrics)."""
    return {"loss": values[0], **dict(zip(metric_names, values[1:])), "examples": int(examples)}


def combine_parts(parts: list[tuple[list[float], int]], metric_names: list[str]) -> dict[str, float]:
    """Loss and metrics of a pass made in parts (``(values, examples)`` each, values weighted by examples)."""
    count = sum(n for _, n in parts)
    if not count:
        raise ConfigurationError(f"the validation data gave no batch: {_WHAT_TO_PASS}, with at least one batch per worker.")
    totals = [sum(values[i] * n for values, n in parts) / count for i in range(len(metric_names) + 1)]
    return named_results(totals, metric_names, count)


def batch_function(model, loss_fn: Callable, metric_fns: dict[str, Callable]) -> Callable:
    """A ``tf.function`` ``(x, y) -> (loss and metrics, examples)`` of one batch, to reuse over passes."""
    import tensorflow as tf

    @tf.function
    def batch_values(x, y):
        logits = model(x, training=False)
        values = [tf.reduce_mean(loss_fn(y, logits))] + [tf.cast(fn(y, logits), tf.float32) for fn in metric_fns.values()]
        return tf.cast(tf.stack(values), tf.float64), tf.cast(tf.shape(x)[0], tf.float64)

    return batch_values


def evaluate_dataset(model, dataset, loss_fn: Callable, metric_fns: dict[str, Callable], example_rank: int,
                     batch_size: int, batch_values: Callable | None = None, steps: int | None = None) -> dict[str, float]:
    """Loss and metrics of ``model`` over one pass of ``dataset``, weighted by examples.

    ``example_rank`` is the rank of one batch of features the model trains on (batch dimension
    included): features of that rank are batches, of one less single examples (batched here).
    """
    import tensorflow as tf

    spec = dataset.element_spec
    if not (isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], tf.TensorSpec)):
        raise ConfigurationError(f"job.evaluate(dataset): its elements are {spec}; {_WHAT_TO_PASS}.")
    if int(dataset.cardinality()) == int(tf.data.INFINITE_CARDINALITY) and steps is None:
        raise ConfigurationError("job.evaluate(dataset): the dataset repeats forever, so one pass never ends; "
                                 f"drop its .repeat() (or .take(n) what to evaluate); {_WHAT_TO_PASS}.")
    rank = spec[0].shape.rank
    if rank == example_rank - 1:
        dataset = dataset.batch(batch_size)
    elif rank != example_rank:
        raise ConfigurationError(
            f"job.evaluate(dataset): its features have shape {spec[0].shape}, and the model takes examples of rank "
            f"{example_rank - 1} (batches of rank {example_rank}); {_WHAT_TO_PASS}."
        )

    if steps is not None:
        dataset = dataset.take(steps)
    batch_values = batch_values or batch_function(model, loss_fn, metric_fns)
    totals, count = None, 0.0
    with tf.device("/job:localhost/replica:0/task:0/device:CPU:0"):
        try:
            for x, y in dataset:
                values, weight = batch_values(x, y)
                totals = values * weight if totals is None else totals + values * weight
                count += float(weight)
        except (tf.errors.OpError, TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"job.evaluate(dataset) failed on its data ({type(exc).__name__}: {first_line(exc, 200)}); "
                f"{_WHAT_TO_PASS}, with features like the training data's."
            ) from None
    if totals is None:
        raise ConfigurationError(f"job.evaluate(dataset): the dataset is empty; {_WHAT_TO_PASS}.")
    return named_results((totals / count).numpy().tolist(), metric_fns, count)
