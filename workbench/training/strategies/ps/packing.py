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

``transfer`` sets the precision a packed group travels in (``wb.AsyncPS(transfer=...)``, ``wb.SyncPS(transfer=...)``): parameters
are encoded on the ps and decoded on the worker, gradients encoded on the worker and decoded on the
ps. ``"bf16"``/``"fp16"`` cast; ``"int8"`` rounds each variable's values to 255 levels of its own
scale (its largest magnitude / 127), the scales travelling in the same tensor, and keeps on the
worker what rounding lost of each gradient, to add to the next one (error feedback). Only
floating-point groups are encoded; loose targets travel as they are.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field

from ...modelling.placement import tf_variable


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
    is off). ``transfer``: the precision groups travel in (see the module's docstring).
    """

    def __init__(self, targets: list, grouped: bool = True, transfer: str = "fp32"):
        self.targets = list(targets)
        self.transfer = transfer
        self._residuals: dict[str, list] = {}  # int8: per worker device, what rounding lost of each group
        self._prefetched: dict[str, list] = {}  # overlapped reads: per worker device, the next step's parameters
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

    def _encoded(self, group: _Group) -> bool:
        return self.transfer != "fp32" and group.dtype.is_floating

    def specs(self, wire: bool = True) -> list[tuple]:
        """``(dtype, shape)`` of each part ``encode`` makes (``wire=False``: ``pack``): one flat tensor per
        group, then each loose target."""
        import tensorflow as tf

        dtypes = {"bf16": tf.bfloat16, "fp16": tf.float16, "int8": tf.int8}
        parts = []
        for g in self.groups:
            if not wire or not self._encoded(g):
                parts.append((g.dtype, [sum(g.sizes)]))
            else:
                extra = 4 * len(g.members) if self.transfer == "int8" else 0  # the scales, as bytes
                parts.append((dtypes[self.transfer], [sum(g.sizes) + extra]))
        loose = [(tf_variable(self.targets[i]).dtype, tf_variable(self.targets[i]).shape) for i in self.loose]
        return parts + loose

    def bytes_per_transfer(self) -> int:
        """Bytes one direction of a step moves (every target, encoded as it travels)."""
        total = 0
        for dtype, shape in self.specs():
            total += dtype.size * math.prod(int(d) for d in shape) if all(d is not None for d in shape) else 0
        return total

    def read(self, parts: list | None = None) -> list:
        """The targets' current values, in order, on the caller's device: one transfer per group.

        ``parts``: the groups' flat values already here (``prefetched_on``): only loose targets are read.
        """
        parts = self.read_parts() if parts is None else [p.read_value() for p in parts]
        return self._split(parts + [tf_variable(self.targets[i]).read_value() for i in self.loose], here=True)

    def read_parts(self) -> list:
        """Each group's flat values, concatenated and encoded on its ps, decoded on the caller's device."""
        import tensorflow as tf

        wire = []
        for group in self.groups:
            with tf.device(group.device):
                flat = tf.concat([tf.reshape(tf_variable(self.targets[i]).read_value(), [-1]) for i in group.members], 0)
                wire.append(self._encode(flat, group))
        return [self._decode(p, g) for p, g in zip(wire, self.groups)]

    def prefetched_on(self, device: str) -> list:
        """Variables on ``device`` (a worker) holding each group's values for its next step, read now."""
        import tensorflow as tf

        if device not in self._prefetched:
            with tf.init_scope(), tf.device(device):
                self._prefetched[device] = [tf.Variable(part, trainable=False, name="prefetched_parameters")
                                            for part in self.read_parts()]
        return self._prefetched[device]

    def pack(self, values: list) -> list:
        """One dense value per target -> the flat parts (one per group, then the loose), on the caller's device."""
        import tensorflow as tf

        packed = [tf.concat([tf.reshape(values[i], [-1]) for i in g.members], 0) for g in self.groups]
        return packed + [values[i] for i in self.loose]

    def encode(self, parts: list, residuals: list | None = None) -> list:
        """Flat parts (``pack``) -> the parts as they travel (``specs``), made here.

        ``residuals`` (int8, from ``residuals_on``): what rounding lost of the previous values, added
        before this rounding and updated with what this one loses (error feedback).
        """
        import tensorflow as tf

        encoded = []
        for index, (group, part) in enumerate(zip(self.groups, parts)):
            if residuals is not None and self._encoded(group) and self.transfer == "int8":
                corrected = part + residuals[index]
                wire = self._encode(corrected, group)
                with tf.control_dependencies([residuals[index].assign(corrected - self._decode(wire, group))]):
                    wire = tf.identity(wire)
                encoded.append(wire)
            else:
                encoded.append(self._encode(part, group))
        return encoded + list(parts[len(self.groups):])

    def decode(self, parts: list) -> list:
        """The inverse of ``encode`` (without what rounding lost), made here: flat parts of the groups' dtypes."""
        return [self._decode(p, g) for p, g in zip(parts, self.groups)] + list(parts[len(self.groups):])

    def unpack(self, parts: list) -> list:
        """Flat parts (``pack``) -> one value per target, each group split on its targets' device."""
        return self._split(parts, here=False)

    def push(self, grads: list, after=None, residuals: list | None = None) -> list:
        """``grads`` (one per target, made here) moved to their targets' devices: one transfer per group.

        They leave once ``after`` exists (a control dependency here, none on the receiving ps),
        encoded here and decoded on the ps. With a sparse or missing gradient they go alone, as
        given (the optimizer places each update with its variable anyway): densifying an
        embedding's gradient costs more.
        """
        import tensorflow as tf

        dense = all(isinstance(grads[i], tf.Tensor) for g in self.groups for i in g.members)
        if not dense:
            with tf.control_dependencies([] if after is None else [after]):
                return [None if p is None else tf.identity(p) for p in grads]
        with tf.control_dependencies([] if after is None else [after]):
            parts = [tf.identity(p) for p in self.encode(self.pack(grads), residuals)]
        flat = []
        for group, part in zip(self.groups, parts):
            with tf.device(group.device):
                flat.append(self._decode(part, group))
        return self.unpack(flat + parts[len(self.groups):])

    def residuals_on(self, device: str) -> list | None:
        """int8: the error-feedback variables of ``device`` (a worker), made there on first use; else None."""
        import tensorflow as tf

        if self.transfer != "int8":
            return None
        if device not in self._residuals:
            with tf.init_scope(), tf.device(device):
                self._residuals[device] = [
                    tf.Variable(tf.zeros([sum(g.sizes)], g.dtype), trainable=False, name="transfer_residual")
                    for g in self.groups]
        return self._residuals[device]

    def release(self) -> None:
        """The job ended: every worker's error-feedback and prefetched variables go."""
        self._residuals.clear()
        self._prefetched.clear()

    def forget(self, device: str) -> bool:
        """The worker on ``device`` was replaced: its error-feedback and prefetched variables went with it.

        True when it held some (functions that used them must be made again).
        """
        held = [self._residuals.pop(device, None), self._prefetched.pop(device, None)]
        return any(h is not None for h in held)

    def _encode(self, flat, group: _Group):
        import tensorflow as tf

        if not self._encoded(group):
            return flat
        if self.transfer in ("bf16", "fp16"):
            return tf.cast(flat, tf.bfloat16 if self.transfer == "bf16" else tf.float16)
        pieces = tf.split(flat, group.sizes)
        scales = tf.stack([tf.maximum(tf.reduce_max(tf.abs(p)), 1e-30) / 127.0 for p in pieces])
        levels = [tf.cast(tf.clip_by_value(tf.round(p / scales[i]), -127.0, 127.0), tf.int8) for i, p in enumerate(pieces)]
        header = tf.reshape(tf.bitcast(tf.cast(scales, tf.float32), tf.int8), [-1])
        return tf.concat([header, *levels], 0)

    def _decode(self, wire, group: _Group):
        import tensorflow as tf

        if not self._encoded(group):
            return wire
        if self.transfer in ("bf16", "fp16"):
            return tf.cast(wire, group.dtype)
        n = len(group.members)
        scales = tf.cast(tf.bitcast(tf.reshape(wire[:4 * n], [n, 4]), tf.float32), group.dtype)
        pieces = tf.split(tf.cast(wire[4 * n:], group.dtype), group.sizes)
        return tf.concat([p * scales[i] for i, p in enumerate(pieces)], 0)

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


def packing_for(model, targets: list, transfer: str = "fp32") -> Packing | None:
    """The packing of a ps job's ``targets``, or None where the model cannot run on packed values.

    A model runs on packed values through ``keras.StatelessScope``, so every trainable variable
    must be a Keras variable. ``WORKBENCH_PACKED_TRANSFERS=0`` (read when a job starts) sends
    every tensor alone, as TensorFlow does by itself: for measuring what packing buys.
    """
    import keras

    if transfer == "fp32" and os.environ.get("WORKBENCH_PACKED_TRANSFERS", "1") == "0":
        return None
    if not all(isinstance(v, keras.Variable) for v in model.trainable_variables):
        return None
    return Packing(targets, transfer=transfer)
