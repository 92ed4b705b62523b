"""TensorFlow's import in an engine, without the libraries Keras loads beside it for a kernel's sake.

``import tensorflow`` loads Keras, and Keras imports, whenever they are installed, pandas (to take DataFrames
in ``fit``), matplotlib's pyplot (for an image gallery) and scikit-learn with SciPy (for its scikit-learn
wrappers). A kernel may want them; an engine never hands Keras a DataFrame, draws, or wraps a model for
scikit-learn (and reads the digits without it: ``workbench.datasets``). So the warm process, and an engine
started as a new Python, import TensorFlow with all four left out: about 0.6 of the import's CPU time and 0.8
of its memory (``bench/startup.py``). Code that imports them later in that process (a user's data function)
gets them as usual; only Keras's own support for them stays off there.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

LEFT_OUT = ("pandas", "matplotlib", "sklearn", "scipy")  # top-level packages Keras imports only when installed


class _LeaveOut(importlib.abc.MetaPathFinder):
    """Answers an import of a LEFT_OUT package, made by the thread that made it, as if the package were not installed
    (an engine's other threads, which may run a user's code while its first import goes on, import as usual)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in LEFT_OUT and threading.get_ident() == self.thread:
            raise ModuleNotFoundError(f"No module named {name!r} (left out of an engine's TensorFlow import)", name=name)
        return None


@contextmanager
def keras_companions_left_out() -> Iterator[None]:
    """Within the block, this thread's import of a LEFT_OUT package fails as if it were not installed (unless it is
    imported already)."""
    finder = _LeaveOut()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def import_tensorflow() -> None:
    """Import TensorFlow (and with it Keras) the engines' way: its optional companions left out."""
    with keras_companions_left_out():
        import tensorflow  # noqa: F401
