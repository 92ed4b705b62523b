"""Versions of the client's software, read without importing TensorFlow (that takes seconds)."""

from __future__ import annotations

import sys

from ... import compat
from ..._version import install_command
from ...errors import TensorFlowImportError


def workbench_version() -> str:
    from ..._version import __version__

    return __version__


def client_tensorflow_version() -> str:
    """The TensorFlow version this process uses (or would import)."""
    module = sys.modules.get("tensorflow")
    if module is not None and getattr(module, "__version__", None):
        return module.__version__
    version = compat.installed(compat.TENSORFLOW_DISTRIBUTIONS)
    if version:
        return version
    raise TensorFlowImportError(
        f"TensorFlow is not installed in this Python ({sys.executable}), the cluster's client: "
        f"`{install_command('cpu')}` (or `{install_command('gpu')}`)."
    )
