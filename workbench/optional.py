"""Optional dependencies, imported through one helper whose error says how to install them."""

from __future__ import annotations

import importlib

from ._version import install_command
from .errors import ConfigurationError

_EXTRAS = {"bokeh": "notebook", "jupyter_bokeh": "notebook", "ipywidgets": "notebook", "tensorboard": "cpu",
           "mlflow": "mlflow", "wandb": "wandb"}


def require(module: str, feature: str):
    """Import ``module`` for ``feature``, or raise an error naming the package to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        extra = _EXTRAS.get(module, "notebook")
        raise ConfigurationError(
            f"{feature} need the {module!r} package, which is not installed: {install_command(extra)} "
            f"(or pip install {module})."
        ) from None
