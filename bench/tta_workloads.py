"""The workloads of ``bench/time_to_accuracy.py``, the same on every side: data, models, and the held-out judge.

- ``mlp``: scikit-learn's digits (8x8, 64 features), an MLP 64-256-256-10 (relu): about 1 ms of compute per
  step of 32 examples here, so transfers and round trips dominate a distributed step.
- ``cnn``: the same digits upsampled to 32x32 (each pixel a 4x4 block), two 3x3 convolutions (32 and 64 filters
  times ``width``, relu, each followed by a 2x2 max-pool) and a dense layer to the 10 classes: several ms of
  compute per step for about 42k parameters (``width`` 1), the compute/transfer ratio of real training.

Every side judges its weights the same way: ``TargetClock`` (a Keras callback, or called by hand where there is
no Keras loop) takes the weights at each epoch's end (``model.get_weights()`` order) and computes the held-out
accuracy with NumPy in the process that asked. That costs the same on every side and is kept off the clock:
its seconds are recorded and subtracted, so a side's time to the target is its training's alone. NumPy, not a
TensorFlow function: a function traced in a cluster's client is registered on every task.
"""

from __future__ import annotations

import functools
import statistics
import time

import numpy as np

WORKLOADS = ("mlp", "cnn")
HIDDEN = 256
UPSAMPLE = 4  # 8x8 digits to 32x32 images


def arrays(workload: str, split: str):
    """``(x, y)`` of ``split`` ("train" or "test") as ``workload``'s model takes them."""
    from workbench.datasets import digits_arrays

    x, y = digits_arrays(split)
    if workload == "cnn":
        images = x.reshape(-1, 8, 8, 1)
        x = np.repeat(np.repeat(images, UPSAMPLE, axis=1), UPSAMPLE, axis=2)
    return x, y


def keras_model(workload: str, width: float = 1.0):
    """The model, as a Keras model (Glorot-uniform kernels, zero biases: Keras's defaults)."""
    import keras

    if workload == "mlp":
        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(HIDDEN, activation="relu"),
                                 keras.layers.Dense(HIDDEN, activation="relu"), keras.layers.Dense(10)])
    first, second = filters(width)
    return keras.Sequential([
        keras.Input((8 * UPSAMPLE, 8 * UPSAMPLE, 1)),
        keras.layers.Conv2D(first, 3, activation="relu"), keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(second, 3, activation="relu"), keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(), keras.layers.Dense(10)])


def filters(width: float) -> tuple[int, int]:
    return max(1, round(32 * width)), max(1, round(64 * width))


def model_fn(workload: str, width: float = 1.0):
    """A function building the model (what ``wb.train`` takes)."""
    return lambda: keras_model(workload, width)


def mlp_data(ctx=None):
    """The MLP's training data as a workbench data function."""
    from workbench.datasets import digits

    return digits(ctx)


def cnn_data(ctx=None):
    """The CNN's training data (32x32 images) as a workbench data function."""
    import tensorflow as tf

    x, y = arrays("cnn", "train")
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    if ctx is not None and ctx.training:
        dataset = dataset.shuffle(len(y), seed=ctx.seed, reshuffle_each_iteration=True)
    return dataset


DATA = {"mlp": mlp_data, "cnn": cnn_data}


def loss():
    """The loss every workload trains with (both models end in logits)."""
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# ---------------------------------------------------------------- the judge, in NumPy


def predict(workload: str, weights: list, x: np.ndarray) -> np.ndarray:
    """Logits of ``x`` under ``weights`` (``keras_model(workload).get_weights()`` order)."""
    if workload == "mlp":
        out = x
        for i in range(0, len(weights), 2):
            out = out @ weights[i] + weights[i + 1]
            if i + 2 < len(weights):
                out = np.maximum(out, 0.0)
        return out
    c1, b1, c2, b2, dense, bias = weights
    out = _pool(np.maximum(_conv(x, c1) + b1, 0.0))
    out = _pool(np.maximum(_conv(out, c2) + b2, 0.0))
    return out.reshape(len(out), -1) @ dense + bias


def _conv(x: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """A 'valid' 3x3 convolution, NHWC, stride 1 (what Conv2D computes)."""
    kh, kw, _, _ = kernel.shape
    windows = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(1, 2))  # n, h, w, c, kh, kw
    return np.tensordot(windows, kernel, axes=([3, 4, 5], [2, 0, 1]))


def _pool(x: np.ndarray) -> np.ndarray:
    n, h, w, c = x.shape
    h, w = h // 2, w // 2
    return x[:, :2 * h, :2 * w].reshape(n, h, 2, w, 2, c).max(axis=(2, 4))


@functools.cache
def _blas_pools():
    """This process's BLAS thread pools (NumPy's), found once: each search walks the loaded libraries."""
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


class TargetClock:
    """When a run trained, and when its held-out accuracy reached ``target`` (host clock, evaluations off it).

    ``call``: when the training call was made; ``first``: when its first call of steps ended; ``evals``:
    ``[time, accuracy, seconds]`` at each epoch's end (the seconds the evaluation took, weights' fetch included).
    ``reached()`` tells the loop to stop. As a Keras callback: ``keras_callback()``.
    """

    def __init__(self, workload: str, target: float):
        self.workload, self.target = workload, target
        self.x, self.y = arrays(workload, "test")
        self.call = time.time()
        self.first: float | None = None
        self.evals: list[list[float]] = []

    def batch_end(self) -> None:
        if self.first is None:
            self.first = time.time()

    def epoch_end(self, get_weights) -> bool:
        """Judge the weights ``get_weights()`` returns now; True once the target is reached."""
        now = time.time()
        # on one BLAS thread: OpenBLAS's threads spin for a while after a call, and took a core from the steps of
        # the next epoch (25 ms an epoch on the CNN, on every side) where this judging is meant to be off the clock
        with _blas_pools().limit(limits=1, user_api="blas"):
            weights = [np.asarray(w, dtype=np.float32) for w in get_weights()]
            accuracy = float(np.mean(np.argmax(predict(self.workload, weights, self.x), axis=1) == self.y))
        self.evals.append([now, accuracy, time.time() - now])
        return self.reached()

    def reached(self) -> bool:
        return bool(self.evals) and self.evals[-1][1] >= self.target

    def result(self, **extra) -> dict:
        return {"call": self.call, "first": self.first, "evals": self.evals, **extra}

    def keras_callback(self):
        import keras

        clock = self

        class TargetCallback(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                clock.batch_end()

            def on_epoch_end(self, epoch, logs=None):
                # ``self.model`` is read inside the judging: an all-reduce job's callbacks' model fetches the weights
                # from worker 0 when read, and the fetch is the judge's, off the clock, as every other side's is
                if clock.epoch_end(lambda: self.model.get_weights()):
                    self.model.stop_training = True

        return TargetCallback()


def time_to_target(result: dict, target: float) -> dict:
    """From one side's ``TargetClock.result()``: seconds to the first epoch end at ``target`` from the call and
    from the first call's end (evaluations before it subtracted), the epochs it took; None where never reached.
    ``epoch_seconds``: the median time an epoch took on the clock (between two judgements, the judging left out),
    over the epochs up to the target: what a side's time is made of apart from how many epochs it needed."""
    judged = 0.0
    evals = result["evals"]
    for index, (when, accuracy, seconds) in enumerate(evals):
        if accuracy >= target:
            before_first = sum(s for t, _, s in evals[:index] if t < (result["first"] or when))
            return {"from_call": when - result["call"] - judged, "epochs": index + 1, "accuracy": accuracy,
                    "from_first": when - (result["first"] or result["call"]) - (judged - before_first),
                    "epoch_seconds": _epoch_seconds(evals[:index + 1])}
        judged += seconds
    return {"from_call": None, "from_first": None, "epochs": len(evals),
            "accuracy": max((a for _, a, _ in evals), default=0.0), "epoch_seconds": _epoch_seconds(evals)}


def _epoch_seconds(evals: list) -> float | None:
    intervals = [later[0] - when - seconds for (when, _, seconds), later in zip(evals, evals[1:])]
    return statistics.median(intervals) if intervals else None
