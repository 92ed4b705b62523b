"""The TensorFlow functions a training job runs on the cluster's tasks.

* ``train_steps(iterator, n)`` (async-ps) runs ``n`` optimizer steps inside one remote call on a
  worker: parameters are read from the ps tasks and updates written back at every step.
* ``push_gradient(iterator, step)`` (sync-ps) computes one gradient on a worker and adds it to a
  conditional accumulator on the ps that holds its variable; gradients stamped with a step that
  is already closed are dropped by the accumulator itself.
* ``close_step(step)`` (sync-ps) runs on ``ps:0`` once the kernel saw the first N - k pushes
  return: it closes the step (late gradients are dropped from now on), averages what arrived,
  applies it, and returns how many gradients it aggregated.
* ``evaluate()`` makes one pass over the evaluation data on a worker.

Every function returns the worker-side ``tf.timestamp()`` of its steps: step timing is measured
where the step runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ConfigurationError


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


def accumulator_step(step):
    """The stamp of step ``t``'s gradients in the conditional accumulators: ``2t``.

    Closing step t sets the accumulator to ``2t + 1`` (late gradients, stamped ``2t``, are dropped);
    taking the aggregate increments it to ``2t + 2``, the stamp of step ``t + 1``.
    """
    return 2 * step


@dataclass
class StepFunctions:
    """The compiled functions of one job; built once, traced on first use."""

    model: Any
    optimizer: Any
    loss_fn: Callable
    metric_fns: dict[str, Callable]

    def _forward(self, x, y, training: bool):
        import tensorflow as tf

        logits = self.model(x, training=training)
        loss = tf.reduce_mean(self.loss_fn(y, logits))
        metrics = [tf.cast(fn(y, logits), tf.float32) for fn in self.metric_fns.values()]
        return loss, metrics

    def _loss_and_grads(self, x, y):
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss, metrics = self._forward(x, y, training=True)
            scaled = loss + sum(self.model.losses) if self.model.losses else loss
        grads = tape.gradient(scaled, self.model.trainable_variables)
        return loss, metrics, grads

    def build_async(self):
        import tensorflow as tf

        n_metrics = len(self.metric_fns)

        @tf.function
        def train_steps(iterator, n):
            losses = tf.TensorArray(tf.float32, size=n)
            metric_values = tf.TensorArray(tf.float32, size=n, element_shape=[n_metrics])
            stamps = tf.TensorArray(tf.float64, size=n + 1)
            stamps = stamps.write(0, tf.timestamp())
            for i in tf.range(n):
                # Steps are strictly sequential: without this, iterations overlap and timestamps lie.
                tf.autograph.experimental.set_loop_options(parallel_iterations=1)
                x, y = next(iterator)
                loss, metrics, grads = self._loss_and_grads(x, y)
                updated = self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
                losses = losses.write(i, loss)
                metric_values = metric_values.write(i, tf.stack(metrics) if metrics else tf.zeros([0]))
                with tf.control_dependencies([loss, *([updated] if updated is not None else [])]):
                    stamps = stamps.write(i + 1, tf.timestamp())
            return losses.stack(), metric_values.stack(), stamps.stack()

        self.train_steps = train_steps

    def build_sync(self, accumulators: list):
        import tensorflow as tf

        variables = self.model.trainable_variables

        @tf.function
        def push_gradient(iterator, step):
            start = tf.timestamp()
            x, y = next(iterator)
            loss, metrics, grads = self._loss_and_grads(x, y)
            applied = [
                tf.raw_ops.ResourceAccumulatorApplyGradient(
                    handle=accumulator, local_step=accumulator_step(step), gradient=tf.convert_to_tensor(grad, dtype=var.dtype))
                for accumulator, grad, var in zip(accumulators, grads, variables)
            ]
            with tf.control_dependencies(applied):
                end = tf.timestamp()
            return loss, tf.stack(metrics) if metrics else tf.zeros([0]), tf.stack([start, end])

        @tf.function
        def close_step(step):
            # Nothing here blocks: the kernel calls it once enough gradients were pushed. (A blocking
            # op on a ps would stall the pushes queued behind it on that task.) From the close on,
            # gradients stamped for this step are dropped; the take then moves the accumulator on
            # to the next step's stamp by itself.
            closed = [tf.raw_ops.ResourceAccumulatorSetGlobalStep(handle=a, new_global_step=accumulator_step(step) + 1)
                      for a in accumulators]
            with tf.control_dependencies(closed):
                aggregated = tf.raw_ops.ResourceAccumulatorNumAccumulated(handle=accumulators[0])
                grads = [tf.raw_ops.ResourceAccumulatorTakeGradient(handle=a, num_required=1, dtype=v.dtype)
                         for a, v in zip(accumulators, variables)]
            self.optimizer.apply_gradients(zip(grads, variables))
            return aggregated

        self.push_gradient = push_gradient
        self.close_step = close_step

    def build_evaluate(self, make_dataset: Callable):
        import tensorflow as tf

        n_metrics = len(self.metric_fns)

        @tf.function
        def evaluate():
            totals = tf.zeros([n_metrics + 1], tf.float64)
            count = tf.constant(0.0, tf.float64)
            for x, y in make_dataset():
                loss, metrics = self._forward(x, y, training=False)
                weight = tf.cast(tf.shape(y)[0], tf.float64)
                totals += weight * tf.cast(tf.stack([loss, *metrics]), tf.float64)
                count += weight
            return totals / tf.maximum(count, 1.0), count

        self.evaluate = evaluate
