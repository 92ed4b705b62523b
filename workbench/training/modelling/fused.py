"""Keras's Adam and SGD updates as TensorFlow's fused kernels, in the steps of the ps strategies.

Keras writes an optimizer's update of one variable as a dozen elementwise ops (Adam: casts, two powers, the two
slot updates, the step size, the division, the assignment). In a ps job every one of them is an op of each step's
graph on the ps: traced in the kernel at every job's start (about 40 % of an async-ps step function's trace on the
digits MLP), instantiated on the tasks at its first call, run by the ps's executor at every step. TensorFlow's own
kernels do the same arithmetic in one op per variable: ``ResourceApplyAdam``, ``ResourceApplyKerasMomentum`` (SGD
with momentum, Nesterov's too) and ``ResourceApplyGradientDescent``.

Only the update itself changes: gradient clipping, weight decay, gradient accumulation, loss scaling, the
learning-rate schedule and the step counter stay Keras's (they come before or after ``update_step``). Another
optimizer, a subclass of theirs (AdamW aside), Adam with ``amsgrad``, a sparse gradient or a dtype the kernels do not take keeps Keras's own
update. The results agree with Keras's to float rounding (``tests/unit/test_fused_updates.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...compat import keras as keras_compat
from .placement import tf_variable

FUSED_DTYPES = ("float16", "bfloat16", "float32", "float64")


def fused_update_step(optimizer: Any) -> Callable | None:
    """``update(gradient, variable, learning_rate)`` in one TensorFlow kernel for this optimizer, or None where its
    update stays Keras's: it is not exactly ``keras.optimizers.Adam`` or ``AdamW`` (its weight decay is applied
    before the update, as with Adam's ``weight_decay``), without ``amsgrad``, or ``SGD``."""
    import keras

    kind = type(optimizer)
    if kind in (keras.optimizers.Adam, keras.optimizers.AdamW) and not optimizer.amsgrad:
        return _adam(optimizer)
    if kind is keras.optimizers.SGD:
        return _sgd(optimizer)
    return None


def takes(gradient: Any, variable: Any) -> bool:
    """Whether a fused kernel can update ``variable`` with ``gradient``: a dense gradient, a floating dtype."""
    import tensorflow as tf

    return not isinstance(gradient, tf.IndexedSlices) and tf.as_dtype(variable.dtype).name in FUSED_DTYPES


def _adam(optimizer: Any) -> Callable:
    import tensorflow as tf

    def update(gradient, variable, learning_rate):
        dtype = tf.as_dtype(variable.dtype)
        step = tf.cast(optimizer.iterations + 1, dtype)
        beta_1, beta_2 = tf.cast(optimizer.beta_1, dtype), tf.cast(optimizer.beta_2, dtype)
        m, v = keras_compat.optimizer_slots(optimizer, variable, "adam")
        return tf.raw_ops.ResourceApplyAdam(
            var=tf_variable(variable).handle, m=tf_variable(m).handle, v=tf_variable(v).handle,
            beta1_power=tf.pow(beta_1, step), beta2_power=tf.pow(beta_2, step), lr=tf.cast(learning_rate, dtype),
            beta1=beta_1, beta2=beta_2, epsilon=tf.cast(optimizer.epsilon, dtype), grad=tf.cast(gradient, dtype))

    return update


def _sgd(optimizer: Any) -> Callable:
    import tensorflow as tf

    def update(gradient, variable, learning_rate):
        dtype = tf.as_dtype(variable.dtype)
        rate, gradient = tf.cast(learning_rate, dtype), tf.cast(gradient, dtype)
        if optimizer.momentum == 0:
            return tf.raw_ops.ResourceApplyGradientDescent(var=tf_variable(variable).handle, alpha=rate, delta=gradient)
        (momentum,) = keras_compat.optimizer_slots(optimizer, variable, "sgd")
        return tf.raw_ops.ResourceApplyKerasMomentum(
            var=tf_variable(variable).handle, accum=tf_variable(momentum).handle, lr=rate, grad=gradient,
            momentum=tf.cast(optimizer.momentum, dtype), use_nesterov=bool(optimizer.nesterov))

    return update
