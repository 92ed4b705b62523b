"""Where variables live: parameter-server placement (greedy by size, large variables partitioned) for ps strategies."""

from __future__ import annotations

import math
from collections import defaultdict

from ...compat import tensorflow as tf_compat


def task_of(device: str) -> str:
    """``"worker:1"`` for ``/job:worker/replica:0/task:1/device:CPU:0``; the device itself (or ``"-"``) if it names no task."""
    parts = dict(p.split(":", 1) for p in device.strip("/").split("/") if ":" in p)
    return f"{parts['job']}:{parts['task']}" if "job" in parts and "task" in parts else device or "-"


def tf_variable(variable):
    """The ``tf.Variable`` itself, or the one inside a Keras variable (``.value``)."""
    import tensorflow as tf

    return variable if isinstance(variable, tf.Variable) else variable.value


def shards_of(variable) -> list:
    """The ``tf.Variable``s holding ``variable``: its shards if it is partitioned, else itself."""
    inner = tf_variable(variable)
    return list(getattr(inner, "variables", None) or [inner])


def variable_device(variable) -> str:
    """The device of a variable (of its first shard, for a partitioned one)."""
    return shards_of(variable)[0].device


def variable_devices(variable) -> list[str]:
    return [shard.device for shard in shards_of(variable)]


def optimizer_targets(variables: list) -> tuple[list, list]:
    """What the optimizer updates: each variable, or each shard of a partitioned one.

    A shard is wrapped in a Keras variable that *is* the shard (no copy), so its slots and its
    update live on the shard's ps. Also returns, per variable, the row count of each shard (or
    None) to split a full gradient the same way.
    """
    import keras
    import tensorflow as tf

    targets, splits = [], []
    for variable in variables:
        shards = shards_of(variable)
        if len(shards) == 1:
            targets.append(variable)
            splits.append(None)
            continue
        splits.append([int(shard.shape[0]) for shard in shards])
        for i, shard in enumerate(shards):
            with tf.variable_creator_scope(lambda _next, shard=shard, **_kwargs: shard):
                targets.append(keras.Variable(tf.zeros(shard.shape, shard.dtype), dtype=shard.dtype,
                                              name=f"{variable.name}_part_{i}"))
    return targets, splits


class PsPlacer:
    """A ``tf.variable_creator_scope`` function putting each new variable on the least-loaded ps.

    Greedy by bytes: large layers spread over the ps tasks instead of piling on ``ps:0`` as
    round-robin would when sizes differ. A variable of ``partition_bytes`` or more is split along
    its first axis over the ps tasks (a ``ShardedVariable``), so no single ps holds or serves all
    of it. ``loads`` shows the resulting bytes per device; ``partitioned`` names the split ones.
    """

    def __init__(self, ps_devices: list[str], partition_bytes: int = 0):
        if not ps_devices:
            raise ValueError("no ps devices to place variables on")
        self.devices = list(ps_devices)
        self.partition_bytes = partition_bytes
        self.loads: dict[str, int] = defaultdict(int)
        self.partitioned: dict[str, list[str]] = {}

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

    def shard_rows(self, shape, nbytes: int) -> list[int] | None:
        """Rows per shard if a variable of this shape and size is to be partitioned, else None."""
        rows = int(shape[0]) if shape is not None and len(shape) >= 1 and shape[0] is not None else 0
        parts = min(len(self.devices), rows)
        if not self.partition_bytes or nbytes < self.partition_bytes or parts < 2:
            return None
        return [rows // parts + (1 if i < rows % parts else 0) for i in range(parts)]

    def __call__(self, next_creator, **kwargs):
        import tensorflow as tf

        value = kwargs.get("initial_value")
        if callable(value):  # Keras passes a lazy initializer: run it to learn the size
            value = kwargs["initial_value"] = value()
        requested = tf_compat.eager_context().device_name or ""
        nbytes = self._bytes(value)
        rows = None if requested.startswith("/job:ps") else self.shard_rows(getattr(value, "shape", None), nbytes)
        if rows is None:
            with tf.device(self.choose(nbytes, requested)):
                return next_creator(**kwargs)
        name = kwargs.get("name") or "variable"
        targets = sorted(self.devices, key=lambda d: (self.loads[d], self.devices.index(d)))[:len(rows)]
        shards = []
        for i, (part, device) in enumerate(zip(tf.split(value, rows, axis=0), targets)):
            self.loads[device] += self._bytes(part)
            with tf.device(device):
                shards.append(next_creator(**{**kwargs, "initial_value": part, "name": f"{name}/part_{i}"}))
        self.partitioned[name] = [shard.device for shard in shards]
        return tf_compat.sharded_variable(shards, name)
