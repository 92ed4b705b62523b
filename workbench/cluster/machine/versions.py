"""Versions of the client's software, read without importing TensorFlow (that takes seconds)."""

from __future__ import annotations

import sys
from importlib import metadata

from ...errors import TensorFlowImportError

# TensorFlow ships under several distribution names; all install the `tensorflow` module.
_TF_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel", "tensorflow-macos", "tf-nightly")


def workbench_version() -> str:
    from ..._version import __version__

    return __version__


def client_tensorflow_version() -> str:
    """The TensorFlow version this process uses (or would import)."""
    module = sys.modules.get("tensorflow")
    if module is not None and getattr(module, "__version__", None):
        return module.__version__
    for name in _TF_DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    raise TensorFlowImportError(
        f"TensorFlow is not installed in this Python ({sys.executable}), the cluster's client: "
        "`pip install 'workbench[cpu]'` (or '[gpu]')."
    )
