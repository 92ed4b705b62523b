"""Where variables live: parameter-server placement (greedy by size) for ps strategies."""

from __future__ import annotations

import math
from collections import defaultdict


def tf_variable(variable):
    """The ``tf.Variable`` itself, or the one inside a Keras variable (``.value``)."""
    import tensorflow as tf

    return variable if isinstance(variable, tf.Variable) else variable.value


def variable_device(variable) -> str:
    return tf_variable(variable).device


class PsPlacer:
    """A ``tf.variable_creator_scope`` function putting each new variable on the least-loaded ps.

    Greedy by bytes: large layers spread over the ps tasks instead of piling on ``ps:0`` as
    round-robin would when sizes differ. ``loads`` shows the resulting bytes per device.
    """

    def __init__(self, ps_devices: list[str]):
        if not ps_devices:
            raise ValueError("no ps devices to place variables on")
        self.devices = list(ps_devices)
        self.loads: dict[str, int] = defaultdict(int)

    @staticmethod
    def _bytes(value) -> int:
        shape = getattr(value, "shape", None)
        try:
            elements = math.prod(int(d) for d in shape) if shape is not None else 1
        except (TypeError, ValueError):
            elements = 1
        size = getattr(getattr(value, "dtype", None), "size", 4) or 4
        return max(1, elements) * size

    def choose(self, nbytes: int, requested: str = "") -> str:
        """The least-loaded ps, unless a ps device is already requested (an optimizer slot colocated
        with its variable: its update then reads it locally)."""
        matching = [d for d in self.devices if requested and d.startswith(requested.split("/device:")[0] + "/")]
        device = matching[0] if matching else min(self.devices, key=lambda d: (self.loads[d], self.devices.index(d)))
        self.loads[device] += nbytes
        return device

    def __call__(self, next_creator, **kwargs):
        import tensorflow as tf
        from tensorflow.python.eager import context

        value = kwargs.get("initial_value")
        if callable(value):  # Keras passes a lazy initializer: run it to learn the size
            value = kwargs["initial_value"] = value()
        with tf.device(self.choose(self._bytes(value), context.context().device_name or "")):
            return next_creator(**kwargs)
