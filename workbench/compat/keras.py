"""Keras internals the workbench uses, each behind one function here (checked on: ``compat.FENCES``).

- ``seed_initializers(seed)``: the seed Keras draws initializer seeds from (``keras.src`` global state), without
  ``tf.random.set_seed``, which clears the eager caches of every connected task and blocks behind a stalled one.
- ``current_layer_path()``: the name scope a variable is being created under (``keras.src`` name scopes), which
  says which layer it belongs to.
- ``learning_rate_schedule(optimizer)``: the schedule an optimizer's learning rate follows, if any (``_learning_rate``).
- ``watch_model_reads(callback, on_read)``: a callback's ``model`` attribute (``Callback._model``) read through a hook.
- ``sum_gradients_as_given(optimizer, how)``: the optimizer's own sum of gradients over replicas
  (``_all_reduce_sum_gradients``), replaced where there are no replicas to sum over.
- ``build_compiled_metrics(model, batch)``: a compiled model's metrics (``_compile_metrics``) built for batches like
  ``batch`` on the model's symbolic output, as ``model.fit`` has them by its first hook: ``model.metrics`` then lists
  them, where a callback monitoring one (``EarlyStopping``, ``ModelCheckpoint``) learns whether it should rise. (Keras's
  own ``_symbolic_build`` builds the loss too and traces the metrics: 23 ms for the digits MLP, against 0.5.)
- ``optimizer_slots(optimizer, variable, kind)``: Adam's or SGD's slot variables of one variable (``_momentums``,
  ``_velocities``, ``momentums`` at ``_get_variable_index``), which the fused updates write.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def seed_initializers(seed: int) -> None:
    """Keras's global seed for its initializers (as ``keras.utils.set_random_seed`` sets it), its seed generator reset."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator
    from keras.src.utils import rng_utils

    global_state.set_global_attribute(rng_utils.GLOBAL_RANDOM_SEED, seed)
    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, None)


def current_layer_path() -> str:
    """The name scope path variables are created under now (``"dense_1/kernel"`` while building layer ``dense_1``)."""
    from keras.src.backend.common.name_scope import current_path

    return current_path()


def sum_gradients_as_given(optimizer: Any, how: Callable) -> None:
    """Replace the optimizer's sum of gradients over replicas with ``how`` (where it has one)."""
    if hasattr(optimizer, "_all_reduce_sum_gradients"):
        optimizer._all_reduce_sum_gradients = how


# the lists of slot variables of each optimizer the fused updates take (``training/modelling/fused.py``)
_SLOT_LISTS = {"adam": ("_momentums", "_velocities"), "sgd": ("momentums",)}


def optimizer_slots(optimizer: Any, variable: Any, kind: str) -> list:
    """The slot variables the optimizer keeps for ``variable``: Adam's ``[m, v]`` (``kind="adam"``), SGD's
    ``[momentum]`` (``kind="sgd"``), in the order of ``_SLOT_LISTS``."""
    index = optimizer._get_variable_index(variable)
    return [getattr(optimizer, name)[index] for name in _SLOT_LISTS[kind]]


def learning_rate_schedule(optimizer: Any) -> Any:
    """The ``LearningRateSchedule`` the optimizer's learning rate follows, else None."""
    import keras

    rate = getattr(optimizer, "_learning_rate", None)
    return rate if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule) else None


def watch_model_reads(callback: Any, on_read: Callable[[], None]) -> type:
    """Make ``callback.model`` call ``on_read()`` before it answers; return the class to put back afterwards.

    Keras's own hook for the same need (``jax_state_sync``) runs in ``Callback.model``; the TensorFlow
    backend has none, so the callback gets a subclass of its own class that adds it.
    """
    base = type(callback)

    def model(self):
        on_read()
        return self._model

    callback.__class__ = type(base.__name__, (base,), {"model": property(model), "__module__": base.__module__,
                                                         "__qualname__": base.__qualname__})
    return base


def build_compiled_metrics(model: Any, batch: tuple[Any, Any]) -> None:
    """Build ``model``'s compiled metrics for batches of ``batch``'s ``(features, labels)`` specs (not run)."""
    import keras

    metrics = getattr(model, "_compile_metrics", None)
    if metrics is None or metrics.built:
        return
    features, labels = keras.tree.map_structure(lambda spec: keras.KerasTensor(spec.shape, spec.dtype.name), batch)
    metrics.build(labels, model.compute_output_spec(features, training=False))
