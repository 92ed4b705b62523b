"""Small real datasets that ship with packages (no downloads), as workbench data functions."""

from __future__ import annotations

import functools


def digits_arrays(split: str = "train", test_fraction: float = 0.25, seed: int = 0):
    """scikit-learn's 8x8 handwritten digits as ``(x float32 [n, 64] in 0..1, y int64 [n])``: new arrays each call."""
    import numpy as np

    data, target = _digits()
    order = np.random.default_rng(seed).permutation(len(target))
    cut = int(len(order) * (1 - test_fraction))
    chosen = order[:cut] if split == "train" else order[cut:]
    return (data[chosen] / 16.0).astype("float32"), target[chosen].astype("int64")


@functools.lru_cache(maxsize=1)
def _digits():
    """The digits as scikit-learn ships them, read once a process (parsing its file takes 40-80 ms, and a job calls
    its data function once per worker and again to learn the example shape); read-only, so no caller changes them."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - depends on the environment
        from .errors import ConfigurationError

        raise ConfigurationError("the digits data needs scikit-learn: pip install scikit-learn") from exc
    digits = load_digits()
    for array in (digits.data, digits.target):
        array.flags.writeable = False
    return digits.data, digits.target


def digits(ctx=None, split: str = "train"):
    """A data function: ``wb.train(..., data=wb.datasets.digits)``; shuffled with ``ctx.seed``."""
    import tensorflow as tf

    x, y = digits_arrays(split)
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    if ctx is not None and ctx.training:
        dataset = dataset.shuffle(len(y), seed=ctx.seed, reshuffle_each_iteration=True)
    return dataset


def digits_test(ctx=None):
    """The held-out quarter of the digits, for ``job.evaluate(wb.datasets.digits_test)``."""
    return digits(None, split="test")
