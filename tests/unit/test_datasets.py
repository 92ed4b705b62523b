"""The shipped digits: scikit-learn's, read without importing it, once a process; every caller gets arrays of its own."""

import subprocess
import sys

import numpy as np

import workbench as wb


def test_digits_arrays_are_the_callers_own_and_the_same_every_call():
    x, y = wb.datasets.digits_arrays("train")
    assert x.dtype == np.float32 and y.dtype == np.int64
    assert x.shape == (1347, 64) and y.shape == (1347,)
    assert 0.0 <= x.min() and x.max() <= 1.0
    expected_x, expected_y = x.copy(), y.copy()
    x[:] = -1.0  # a caller that changes its arrays changes no one else's
    y[:] = -1
    again_x, again_y = wb.datasets.digits_arrays("train")
    np.testing.assert_array_equal(again_x, expected_x)
    np.testing.assert_array_equal(again_y, expected_y)


def test_the_two_splits_partition_the_digits():
    train_x, _ = wb.datasets.digits_arrays("train")
    test_x, test_y = wb.datasets.digits_arrays("test")
    assert len(train_x) + len(test_x) == 1797 and len(test_y) == len(test_x)
    other_x, _ = wb.datasets.digits_arrays("test", seed=1)
    assert not np.array_equal(other_x, test_x)  # another seed, another split


def test_the_digits_are_scikit_learns_read_without_importing_it():
    from sklearn.datasets import load_digits

    from workbench import datasets

    data, target = datasets._digits()
    shipped = load_digits()
    np.testing.assert_array_equal(data, shipped.data)
    np.testing.assert_array_equal(target, shipped.target)
    assert target.dtype == shipped.target.dtype
    # read from the file itself, not load_digits (an engine imports neither scikit-learn nor SciPy)
    child = subprocess.run([sys.executable, "-c", "import sys\nfrom workbench import datasets\ndatasets._digits()\n"
                            "print(sorted({'sklearn', 'scipy'} & set(sys.modules)))"], capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 0 and child.stdout.strip() == "[]", (child.stdout, child.stderr[-2000:])
