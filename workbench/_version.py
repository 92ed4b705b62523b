"""The installed distribution's name and version (the version is written once, in extension/package.json)."""

from importlib import metadata

DISTRIBUTION = "jupyter-tf-workbench"  # the name on PyPI; "workbench" there is an unrelated project

try:
    __version__ = metadata.version(DISTRIBUTION)
except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
