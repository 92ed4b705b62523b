"""Packed transfers: a worker reads each ps's parameters as one tensor and pushes its gradients as one.

TensorFlow moves every tensor between tasks with an RPC of its own, and each costs CPU on both
sides whatever its size. Reading a model's 6 variables (336 kB) from one ps and adding 6
gradients back took 3.3 ms of CPU per step (ps and worker together) on this 2-core machine; the
same bytes as one tensor each way took 2.2 ms, and a step moving 64 bytes took 1.6 ms
(``python bench/transfers.py``). So the parameters a ps holds are concatenated there, sent as one
tensor and split on the worker; the gradients are concatenated on the worker, sent as one tensor
and split on the ps, where the optimizer applies them. One group per ps task and dtype.

Variables of unknown shape and sparse gradients (``tf.IndexedSlices``) travel on their own, as
before: densifying an embedding's gradient would cost more than it saves.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field

from .placement import tf_variable


@dataclass
class _Group:
    device: str
    dtype: object
    members: list[int] = field(default_factory=list)  # indices into the targets
    shapes: list = field(default_factory=list)

    @property
    def sizes(self) -> list[int]:
        return [math.prod(shape) for shape in self.shapes]


class Packing:
    """How the targets of an optimizer (variables, or shards of partitioned ones) travel in groups.

    ``grouped=False`` makes every target a group of its own (sync-ps's queue layout when packing
    is off).
    """

    def __init__(self, targets: list, grouped: bool = True):
        self.targets = list(targets)
        groups: dict[tuple, _Group] = {}
        self.loose: list[int] = []  # travel alone: shapes not fully known, or alone on their ps
        for index, target in enumerate(self.targets):
            variable = tf_variable(target)
            if not grouped or not variable.shape.is_fully_defined():
                self.loose.append(index)
                continue
            group = groups.setdefault((variable.device, variable.dtype), _Group(variable.device, variable.dtype))
            group.members.append(index)
            group.shapes.append(tuple(int(d) for d in variable.shape))
        self.groups = [g for g in groups.values() if len(g.members) > 1]
        self.loose = sorted(self.loose + [i for g in groups.values() if len(g.members) == 1 for i in g.members])

    def specs(self) -> list[tuple]:
        """``(dtype, shape)`` of each part ``pack`` makes: one flat tensor per group, then each loose target."""
        loose = [(tf_variable(self.targets[i]).dtype, tf_variable(self.targets[i]).shape) for i in self.loose]
        return [(g.dtype, [sum(g.sizes)]) for g in self.groups] + loose

    def read(self) -> list:
        """The targets' current values, in order, on the caller's device: one transfer per group."""
        import tensorflow as tf

        parts = []
        for group in self.groups:
            with tf.device(group.device):
                parts.append(tf.concat([tf.reshape(tf_variable(self.targets[i]).read_value(), [-1])
                                        for i in group.members], 0))
        parts += [tf_variable(self.targets[i]).read_value() for i in self.loose]
        return self._split(parts, here=True)

    def pack(self, values: list) -> list:
        """One dense value per target -> the parts (``specs``), made on the caller's device."""
        import tensorflow as tf

        packed = [tf.concat([tf.reshape(values[i], [-1]) for i in g.members], 0) for g in self.groups]
        return packed + [values[i] for i in self.loose]

    def unpack(self, parts: list) -> list:
        """The parts of ``pack`` -> one value per target, each group split on its targets' device."""
        return self._split(parts, here=False)

    def push(self, grads: list, after=None) -> list:
        """``grads`` (one per target, made here) moved to their targets' devices: one transfer per group.

        They leave once ``after`` exists (a control dependency here, none on the receiving ps).
        With a sparse or missing gradient they go alone, as given (the optimizer places each
        update with its variable anyway): densifying an embedding's gradient costs more.
        """
        import tensorflow as tf

        dense = all(isinstance(grads[i], tf.Tensor) for g in self.groups for i in g.members)
        with tf.control_dependencies([] if after is None else [after]):
            parts = [None if p is None else tf.identity(p) for p in (self.pack(grads) if dense else grads)]
        return self.unpack(parts) if dense else parts

    def _split(self, parts: list, here: bool) -> list:
        import tensorflow as tf

        values: list = [None] * len(self.targets)
        for group, packed in zip(self.groups, parts):
            with contextlib.nullcontext() if here else tf.device(group.device):
                for i, part, shape in zip(group.members, tf.split(packed, group.sizes), group.shapes):
                    values[i] = tf.reshape(part, shape)
        for i, value in zip(self.loose, parts[len(self.groups):]):
            values[i] = value
        return values


def packing_for(model, targets: list) -> Packing | None:
    """The packing of a ps job's ``targets``, or None where the model cannot run on packed values.

    A model runs on packed values through ``keras.StatelessScope``, so every trainable variable
    must be a Keras variable. ``WORKBENCH_PACKED_TRANSFERS=0`` (read when a job starts) sends
    every tensor alone, as TensorFlow does by itself: for measuring what packing buys.
    """
    import keras

    if os.environ.get("WORKBENCH_PACKED_TRANSFERS", "1") == "0":
        return None
    if not all(isinstance(v, keras.Variable) for v in model.trainable_variables):
        return None
    return Packing(targets)
