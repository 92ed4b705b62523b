"""TensorFlow's import in an engine, without the dataframe and plotting libraries Keras loads beside it.

``import tensorflow`` loads Keras, and Keras imports pandas (to take DataFrames in ``fit``) and matplotlib's
pyplot (for an image gallery) whenever they are installed. A kernel wants them; an engine never hands Keras
a DataFrame nor draws. So the warm process, and an engine started as a new Python, import TensorFlow with
both left out: about a seventh of the import's CPU time and a seventh of the process's memory
(``bench/startup.py``). Code that imports them later in that process (a user's
data function) gets them as usual; only Keras's own DataFrame support stays off there.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Iterator
from contextlib import contextmanager

LEFT_OUT = ("pandas", "matplotlib")  # top-level packages Keras imports only when they are installed


class _LeaveOut(importlib.abc.MetaPathFinder):
    """Answers an import of a LEFT_OUT package as if it were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in LEFT_OUT:
            raise ModuleNotFoundError(f"No module named {name!r} (left out of an engine's TensorFlow import)", name=name)
        return None


@contextmanager
def keras_companions_left_out() -> Iterator[None]:
    """Within the block, importing pandas or matplotlib fails as if they were not installed (unless imported already)."""
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

