"""Small real datasets that ship with packages (no downloads), as workbench data functions."""

from __future__ import annotations

import functools
from pathlib import Path


def digits_arrays(split: str = "train", test_fraction: float = 0.25, seed: int = 0):
    """scikit-learn's 8x8 handwritten digits as ``(x float32 [n, 64] in 0..1, y int64 [n])``: new arrays each call."""
    import numpy as np

    data, target = _digits()
    order = np.random.default_rng(seed).permutation(len(target))
    cut = int(len(order) * (1 - test_fraction))
    chosen = order[:cut] if split == "train" else order[cut:]
    return (data[chosen] / 16.0).astype("float32"), target[chosen].astype("int64")


DIGITS_FILE = ("datasets", "data", "digits.csv.gz")  # where in scikit-learn's package its digits are


@functools.lru_cache(maxsize=1)
def _digits():
    """The digits as scikit-learn ships them, read once a process (parsing its file takes 40-80 ms, and a job calls
    its data function once per worker and again to learn the example shape); read-only, so no caller changes them.

    The file is read as ``load_digits`` reads it, without importing scikit-learn: an engine imports neither it nor
    SciPy (``cluster.launch.lean_import``), and would spend a second of CPU and 80 MiB on them for one file.
    ``load_digits`` itself reads it where scikit-learn keeps it elsewhere.
    """
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        from .errors import ConfigurationError

        raise ConfigurationError("the digits data needs scikit-learn: pip install scikit-learn")
    path = Path(spec.submodule_search_locations[0], *DIGITS_FILE)
    if path.is_file():
        table = np.loadtxt(path, delimiter=",")  # gzip-compressed: numpy opens it as such
        data, target = table[:, :-1], table[:, -1].astype(int)
    else:  # pragma: no cover - a scikit-learn that keeps the file elsewhere
        from sklearn.datasets import load_digits

        loaded = load_digits()
        data, target = loaded.data, loaded.target
    for array in (data, target):
        array.flags.writeable = False
    return data, target


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
