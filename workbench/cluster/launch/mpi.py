"""``engines="mpi"``: what mpiexec needs that a user should not have to find out from its error messages.

ipyparallel's MPI launcher runs ``mpiexec -n N [mpi_args] <engine> --mpi``; each engine then
imports mpi4py. Checked before anything starts: mpiexec is on ``PATH`` and mpi4py is importable
by the engines' Python (when that is this Python, the launcher's default). Added for Open MPI,
each with a notice saying so, unless the user's ``mpi_args`` already decide it:

- ``--allow-run-as-root`` when this process runs as root (Open MPI refuses root otherwise);
- ``--oversubscribe`` when the engines run on this machine only (no host list, no batch
  allocation) and there are more of them than physical cores (Open MPI refuses more ranks than
  slots otherwise, and counts a slot per core);
- ``--bind-to none``: Open MPI pins each rank of a small job to one core, and an engine is a
  multi-threaded TensorFlow server (a second ``mpiexec -n 1`` from ``scale()`` put a worker on
  core 0 only, and training crawled).

MPICH (Hydra) needs neither, and other MPIs are left as they are.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys

import psutil

from ..._version import install_command
from ...errors import ConfigurationError

VERSION_TIMEOUT = 10.0
ROOT_FLAG = "--allow-run-as-root"
OVERSUBSCRIBE_FLAG = "--oversubscribe"
BIND_OPTIONS = ("--bind-to", "-bind-to", "--cpu-set", "--cpus-per-rank", "--cpus-per-proc")
# mpiexec options that place ranks on other hosts, and variables of batch allocations Open MPI reads
HOST_OPTIONS = ("-H", "--host", "-host", "--hostfile", "-hostfile", "--machinefile", "-machinefile",
                "--default-hostfile", "--rankfile", "-rf")
ALLOCATION_VARIABLES = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "PE_HOSTFILE", "OMPI_MCA_orte_default_hostfile")


def check(mpi_cmd: list[str], engines_use_this_python: bool) -> None:
    """Raise a ``ConfigurationError`` saying what to install when mpiexec or the engines' mpi4py is missing."""
    if not mpi_cmd or shutil.which(mpi_cmd[0]) is None:
        raise ConfigurationError(
            f"engines='mpi' runs the engines with {mpi_cmd[0] if mpi_cmd else 'mpiexec'!r}, which is not on PATH. "
            "Install an MPI (Debian/Ubuntu: apt-get install openmpi-bin) or load your site's MPI module, or pass "
            "mpi_cmd=['/path/to/mpiexec'].")
    if engines_use_this_python and importlib.util.find_spec("mpi4py") is None:
        raise ConfigurationError(
            f"engines='mpi' starts each engine with `ipengine --mpi`, which imports mpi4py, and {sys.executable} "
            f"has none. Install it into this environment ({install_command('mpi')}, or pip install mpi4py) and "
            "start the cluster again.")


def flavour(mpi_cmd: list[str]) -> str:
    """``"openmpi"``, ``"mpich"`` or ``""`` (unknown), from ``mpiexec --version`` (asked once per command)."""
    return _flavour(tuple(mpi_cmd))


@functools.cache
def _flavour(mpi_cmd: tuple[str, ...]) -> str:
    try:
        result = subprocess.run([*mpi_cmd, "--version"], capture_output=True, text=True, timeout=VERSION_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    text = result.stdout + result.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    if "HYDRA" in text or "MPICH" in text:
        return "mpich"
    return ""


def added_args(mpi_cmd: list[str], mpi_args: list[str], n: int) -> tuple[list[str], list[str]]:
    """The mpiexec options the workbench adds for ``n`` engines, and one notice per option saying why."""
    if flavour(mpi_cmd) != "openmpi":
        return [], []
    given = set(mpi_args)
    added, notices = [], []
    if os.geteuid() == 0 and ROOT_FLAG not in given and not _root_allowed_by_environment():
        added.append(ROOT_FLAG)
        notices.append(f"this kernel runs as root and Open MPI refuses root without {ROOT_FLAG}: the workbench added it "
                       "to mpiexec's options")
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    on_this_machine = not (given & set(HOST_OPTIONS)) and not any(v in os.environ for v in ALLOCATION_VARIABLES)
    if on_this_machine and n > cores and OVERSUBSCRIBE_FLAG not in given and "--map-by" not in given:
        added.append(OVERSUBSCRIBE_FLAG)
        notices.append(f"{n} engines on this machine's {cores} core(s), more than Open MPI's slots: the workbench added "
                       f"{OVERSUBSCRIBE_FLAG} to mpiexec's options")
    if not given & set(BIND_OPTIONS):
        added += ["--bind-to", "none"]
        notices.append("engines are multi-threaded TensorFlow servers and Open MPI pins small jobs' ranks to one core "
                       "each: the workbench added --bind-to none to mpiexec's options (pass your own --bind-to to choose)")
    return added, notices


def _root_allowed_by_environment() -> bool:
    return os.environ.get("OMPI_ALLOW_RUN_AS_ROOT") == "1" and os.environ.get("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM") == "1"
