"""Losses and per-batch metrics, resolved from what the user passed (names, Keras objects, functions)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...errors import ConfigurationError


def resolve_loss(loss: Any) -> Callable:
    import keras

    try:
        return keras.losses.get(loss)
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(
            f"loss={loss!r} is not a Keras loss: pass a name such as 'sparse_categorical_crossentropy', a "
            f"keras.losses.Loss, or a function (y_true, y_pred) -> scalar. ({exc})"
        ) from None


def _accuracy(y_true, y_pred):
    import tensorflow as tf

    classes = y_pred.shape[-1] or 1
    sparse = y_true.shape.rank == y_pred.shape.rank - 1 or (classes > 1 and y_true.shape[-1] == 1)
    if sparse:  # integer labels, one score per class
        labels = tf.reshape(tf.cast(y_true, tf.int64), [-1])
        predicted = tf.argmax(tf.reshape(y_pred, [tf.shape(labels)[0], -1]), axis=-1)
    elif classes > 1:  # one-hot labels
        labels, predicted = tf.argmax(y_true, -1), tf.argmax(y_pred, -1)
    else:  # binary, probabilities
        labels = tf.reshape(tf.cast(y_true, tf.float32), [-1])
        predicted = tf.cast(tf.reshape(y_pred, [-1]) > 0.5, tf.float32)
    return tf.reduce_mean(tf.cast(tf.equal(labels, predicted), tf.float32))


def _mae(y_true, y_pred):
    import tensorflow as tf

    return tf.reduce_mean(tf.abs(tf.cast(y_true, y_pred.dtype) - y_pred))


def _mse(y_true, y_pred):
    import tensorflow as tf

    return tf.reduce_mean(tf.square(tf.cast(y_true, y_pred.dtype) - y_pred))


_METRICS = {"accuracy": _accuracy, "acc": _accuracy, "mae": _mae, "mse": _mse}


def resolve_metrics(metrics: Any) -> dict[str, Callable]:
    """``["accuracy", my_fn]`` -> ``{"accuracy": fn, "my_fn": my_fn}``: stateless per-batch functions."""
    resolved: dict[str, Callable] = {}
    for metric in metrics or ():
        if isinstance(metric, str):
            if metric not in _METRICS:
                raise ConfigurationError(
                    f"metric {metric!r} is not known: use one of {', '.join(sorted(_METRICS))}, or a function "
                    "(y_true, y_pred) -> scalar tensor."
                )
            resolved["accuracy" if metric == "acc" else metric] = _METRICS[metric]
        elif callable(metric):
            resolved[getattr(metric, "__name__", f"metric_{len(resolved)}")] = metric
        else:
            raise ConfigurationError(f"metric {metric!r} is neither a name nor a function (y_true, y_pred) -> scalar.")
    return resolved
