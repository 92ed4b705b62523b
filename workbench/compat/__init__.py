"""What the workbench takes from other libraries' internals, fenced: one module per library.

Every use of a private part of TensorFlow (``tensorflow.py``), Keras (``keras.py``), ipyparallel
(``ipyparallel.py``), jupyter_bokeh (``jupyter_bokeh.py``), Bokeh (``bokeh.py``) or MLflow (``mlflow.py``)
goes through a function of that library's module here; the rest of the package imports no internal module
of theirs (``tests/unit/test_layout.py`` checks it). ``FENCES`` says, per library, the versions those functions were checked on (those
``pyproject.toml`` admits: CI tests the newest) and what may break outside them; importing the workbench
with another version warns once (``UncheckedVersionWarning``) naming both.

This package imports no other workbench module but ``workbench.errors``: every room may use it.
"""

from __future__ import annotations

import re
import warnings
from importlib import metadata

from ..errors import UncheckedVersionWarning

# TensorFlow ships under several distribution names; all install the `tensorflow` module.
TENSORFLOW_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel", "tensorflow-macos",
                            "tf-nightly")
# distribution names, [lowest, below) the versions checked, and what relies on the internals
FENCES = {
    "TensorFlow": (TENSORFLOW_DISTRIBUTIONS, "2.21", "2.22", "scaling and re-hosting (the kernel's connection updated in "
                   "place), workers' own executors, partitioned ps variables, autograph's files, function registration and "
                   "removal without the GIL, all-reduce workers' input deleted at once, their traced steps let go and large blocks "
                   "kept in their heaps"),
    "Keras": (("keras",), "3.12", "3.16", "seeded initial weights, layer-by-layer placement (wb.place), ps optimizer "
              "updates, callbacks monitoring a metric"),
    "ipyparallel": (("ipyparallel",), "9.2", "9.3", "engines forked from the warm process, launchers' logs and "
                    "exits, attaching to a running cluster"),
    "jupyter_bokeh": (("jupyter_bokeh", "jupyter-bokeh"), "4.0", "4.2", "live dashboards in a notebook"),
    "Bokeh": (("bokeh",), "3.6", "4.0", "dashboards served on a port the system chose"),
    "MLflow": (("mlflow", "mlflow-skinny"), "3.1", "4.0", "MLflow's Keras callbacks in wb.train (the caller's active run "
               "seen from the job's thread)"),
}


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def installed(distributions: tuple[str, ...]) -> str:
    """The version of the first of ``distributions`` installed, or ``""``."""
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return ""


def outside(library: str, version: str) -> str:
    """Why ``version`` of ``library`` (a key of ``FENCES``) may break the workbench, or ``""`` if it was checked."""
    distributions, lowest, below, features = FENCES[library]
    if _release(lowest) <= _release(version) < _release(below):
        return ""
    return (f"{library} {version} is outside {lowest} to below {below}, the versions the workbench was checked on: "
            f"{features} may break. Install a checked one: pip install '{distributions[0]}>={lowest},<{below}'.")


def unchecked() -> list[str]:
    """One line per fenced library whose installed version is outside the checked range."""
    found = {library: installed(distributions) for library, (distributions, *_rest) in FENCES.items()}
    return [line for line in (outside(library, version) for library, version in found.items() if version) if line]


def warn_unchecked() -> None:
    """Warn once per unchecked library (at ``import workbench``)."""
    for line in unchecked():
        warnings.warn(line, UncheckedVersionWarning, stacklevel=3)
