"""What a job builds from the user's arguments: the model, the optimizer, seeded initial weights."""

from __future__ import annotations

import logging
from typing import Any

from ...compat import keras as keras_compat
from ...errors import ConfigurationError
from .fused import fused_update_step, takes
from .placement import variable_device

log = logging.getLogger(__name__)


def seed_initializers(seed: int) -> None:
    """What ``keras.utils.set_random_seed`` does, minus ``tf.random.set_seed``.

    Keras draws initializer seeds from Python's ``random``. TensorFlow's global seed is left
    alone: setting it clears the eager caches of every connected task and blocks while any of
    them is stalled. Data pipelines get their seed explicitly (``ctx.seed``).
    """
    import random

    import numpy as np

    keras_compat.seed_initializers(seed)
    random.seed(seed)
    np.random.seed(seed)


def build_model(model: Any, example_features) -> Any:
    import keras
    import tensorflow as tf

    if isinstance(model, keras.Model):
        try:
            built = keras.models.clone_model(model)
        except Exception as exc:  # noqa: BLE001 - subclassed models cannot be cloned; say what to pass instead
            raise ConfigurationError(
                f"cannot re-create {type(model).__name__} with its variables on the ps tasks ({exc}): pass a "
                "function that builds the model instead, e.g. model=make_model."
            ) from None
    elif callable(model):
        built = model()
        if not isinstance(built, keras.Model):
            raise ConfigurationError(f"the model function returned {type(built).__name__}, not a keras.Model.")
    else:
        raise ConfigurationError(f"model={model!r}: pass a function that builds a keras.Model (or a keras.Model).")
    if not built.built or not built.weights:
        built(tf.zeros([1, *example_features.shape[1:]], example_features.dtype))
    return built


LOCAL_CPU = "/job:localhost/replica:0/task:0/device:CPU:0"  # this kernel's own CPU, whatever it is connected to


def local_model(model: Any, example_shape: list, example_dtype: Any, weights: list) -> Any:
    """A Keras model in this kernel (no cluster needed) holding ``weights``: ``job.model``."""
    import tensorflow as tf

    with tf.device(LOCAL_CPU):
        local = build_model(model, tf.zeros(example_shape, example_dtype))
    local.set_weights(weights)
    return local


def build_optimizer(optimizer: Any) -> Any:
    import keras

    if isinstance(optimizer, keras.optimizers.Optimizer):
        # Re-create it here so that its variables (iterations, slots) live on the ps tasks too.
        return type(optimizer).from_config(optimizer.get_config())
    if isinstance(optimizer, (str, dict)):  # a name, or a config {"class_name": ..., "config": {...}}
        try:
            return keras.optimizers.get(optimizer)
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(f"optimizer={optimizer!r} is not a Keras optimizer: {exc}") from None
    if callable(optimizer):
        return build_optimizer(optimizer())
    raise ConfigurationError(f"optimizer={optimizer!r}: pass a name ('adam'), a keras optimizer, or a function returning one.")


def update_where_the_variable_lives(optimizer) -> None:
    """Run the optimizer's update math on the ps tasks, none of it on the caller's device.

    Keras places an update under the caller's device, so an update issued from a worker would read
    the optimizer slots (e.g. Adam's m and v) from the ps, compute there and write them back: about
    four times the bytes of a gradient push. Colocated, a step moves the parameters and the gradient.
    The step counter and the learning rate are worked out where the counter lives: from a worker,
    ``iterations.assign_add(1)`` would read it, add and send it back, two more transfers per step.
    Only for ps strategies: no distribution strategy is in scope there. Adam's and SGD's update is one fused
    TensorFlow kernel per variable (``fused.py``): fewer ops to trace, instantiate and run at every step.
    """
    import tensorflow as tf

    update_step, apply = optimizer.update_step, optimizer.apply
    fused = fused_update_step(optimizer)

    def colocated(gradient, variable, learning_rate):
        with tf.device(variable_device(variable)):
            if fused is not None and takes(gradient, variable):
                return fused(gradient, variable, learning_rate)
            return update_step(gradient, variable, learning_rate)

    def applied_by_the_counter(grads, trainable_variables=None):
        with tf.device(variable_device(optimizer.iterations)):
            return apply(grads, trainable_variables)

    def as_they_are(grads_and_vars):
        # No replicas to sum over: the default strategy's all-reduce is an identity, placed on the
        # device of the call, which would carry every other ps's gradients there and back.
        return list(grads_and_vars)

    optimizer.update_step = colocated
    optimizer.apply = applied_by_the_counter
    keras_compat.sum_gradients_as_given(optimizer, as_they_are)


def learning_rate_of(optimizer) -> float | None:
    """The optimizer's learning rate as a number; None where it follows a schedule (Keras cannot set one then)."""
    import tensorflow as tf

    if keras_compat.learning_rate_schedule(optimizer) is not None:
        return None
    return float(tf.convert_to_tensor(optimizer.learning_rate).numpy())


def compile_like_the_job(model: Any, optimizer: Any, loss: Any, metrics: Any, batch: tuple[Any, Any]) -> None:
    """Compile the callbacks' ``model`` with the job's optimizer, loss and metrics, and build the metrics for the
    job's ``batch`` (``data.batch_spec``), as ``model.fit`` has before its first hook: a callback that monitors a
    metric with ``mode="auto"`` (``EarlyStopping(monitor="val_accuracy")``) finds it in ``model.metrics`` and
    whether it should rise or fall."""
    model.compile(optimizer=optimizer, loss=loss, metrics=list(metrics))
    try:
        keras_compat.build_compiled_metrics(model, batch)
    except Exception:  # a model Keras cannot call symbolically: a monitoring callback then asks for mode= itself
        log.debug("the callbacks' model's metrics were not built", exc_info=True)


def compiled_settings(model: Any, loss: Any, optimizer: Any, metrics: Any) -> tuple[Any, Any, tuple]:
    """``(loss, optimizer, metrics)`` as Keras users expect from ``compile`` then ``fit``: each one not given is the
    compiled model's when ``model`` returns a compiled one (the call's arguments win), else ``"adam"`` and no
    metrics; a loss is needed from one or the other."""
    compiled = None if None not in (loss, optimizer, metrics) else _compiled_model(model)
    if compiled is None:
        if loss is None:
            raise ConfigurationError("wb.train needs a loss: pass loss= (e.g. 'sparse_categorical_crossentropy'), or "
                                     "compile the model the model function returns (model.compile(loss=..., optimizer=...)).")
        return loss, "adam" if optimizer is None else optimizer, tuple(metrics or ())
    import keras

    return (compiled.loss if loss is None else loss,
            keras.optimizers.serialize(compiled.optimizer) if optimizer is None else optimizer,
            _compiled_metrics(compiled) if metrics is None else tuple(metrics))


def _compiled_model(model: Any):
    """The compiled Keras model ``model`` stands for, or None (built here, on this kernel's CPU, only to look)."""
    import keras
    import tensorflow as tf

    built = getattr(model, "model", model)  # a placed model (wb.place) holds its Keras model
    if not isinstance(built, keras.Model) and callable(built):
        try:
            with tf.device(LOCAL_CPU):
                built = built()
        except Exception:  # noqa: BLE001 - the job's set-up builds it again and says what is wrong
            return None
    if not isinstance(built, keras.Model) or not getattr(built, "compiled", False) or built.loss is None:
        return None
    return built


def _compiled_metrics(model) -> tuple:
    """The metrics ``model`` was compiled with, as ``wb.train`` computes them (names, or functions)."""
    import keras

    found = []
    for metric in (model.get_compile_config() or {}).get("metrics") or ():
        if isinstance(metric, dict):
            metric = keras.saving.deserialize_keras_object(metric)
        if isinstance(metric, keras.metrics.Metric) or not (isinstance(metric, str) or callable(metric)):
            raise ConfigurationError(
                f"the model was compiled with metric {metric!r}, which wb.train computes per batch only from a name "
                "('accuracy', 'mae', 'mse') or a function (y_true, y_pred) -> scalar: pass metrics=[...] to wb.train.")
        found.append(metric)
    return tuple(found)
