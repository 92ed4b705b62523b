"""The installed distribution's name and version (the version is written once, in extension/package.json)."""

import warnings
from importlib import metadata

DISTRIBUTION = "jupyter-tf-workbench"  # the name on PyPI; "workbench" there is an unrelated project
CLASHING = "workbench"  # that project: it ships an import package `workbench` and a `workbench` command too


def install_command(extras: str) -> str:
    """What to type to install this distribution with ``extras`` (``"cpu"``, ``"gpu"``, ``"mpi"``...), for messages."""
    return f"pip install '{DISTRIBUTION}[{extras}]'"


try:
    __version__ = metadata.version(DISTRIBUTION)
except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"


def _warn_if_clashing() -> None:
    try:
        other = metadata.version(CLASHING)
    except metadata.PackageNotFoundError:
        return
    warnings.warn(f"the distribution {CLASHING!r} {other} is installed in this environment beside {DISTRIBUTION}: both "
                  f"ship the import package `workbench`, and their files overwrite each other. Run: pip uninstall "
                  f"{CLASHING} && pip install --force-reinstall --no-deps {DISTRIBUTION}", UserWarning, stacklevel=3)


_warn_if_clashing()
