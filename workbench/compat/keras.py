"""Keras internals the workbench uses, each behind one function here. Checked on Keras 3.3 to 3.13.

- ``seed_initializers(seed)``: the seed Keras draws initializer seeds from (``keras.src`` global state), without
  ``tf.random.set_seed``, which clears the eager caches of every connected task and blocks behind a stalled one.
- ``current_layer_path()``: the name scope a variable is being created under (``keras.src`` name scopes), which
  says which layer it belongs to.
- ``sum_gradients_as_given(optimizer, how)``: the optimizer's own sum of gradients over replicas
  (``_all_reduce_sum_gradients``), replaced where there are no replicas to sum over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CHECKED = ("keras", "3.3", "3.14")  # [from, below): the versions every function here was checked on


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
