"""The "Python 3 (workbench)" Jupyter kernel: ipykernel with the bind shim preloaded.

Its kernelspec (``share/jupyter/kernels/workbench/kernel.json``, installed with the package) runs
``python -m workbench.kernel -f {connection_file}``. This puts the bind shim in ``LD_PRELOAD`` and
replaces itself (``exec``) with ipykernel, so whatever starts the kernel (plain ``jupyter lab``,
JupyterHub, VS Code, nbclient, papermill, Binder) gets one whose TensorFlow ports listen on loopback,
with no flag and nothing to remember. Its threads share two malloc heaps from its start (``MALLOC_ARENA_MAX``,
unless set), so that a kernel that runs many jobs stays lean. Before the first cell it also sends TensorFlow's, absl's and gRPC's
C++ log lines to a log file (``workbench.native_logs``), so that even ``import tensorflow`` in the
first cell prints nothing there. The tutorials name this kernel. A kernel started any other way
is protected too, from its first connection to a cluster (``workbench.cluster.process.bind_hook``); the
preloaded shim also covers TensorFlow servers the user starts by hand.

Where the shim cannot be built (no C compiler, not Linux) the kernel starts anyway, without it, and
the reason is kept in ``WORKBENCH_BIND_SHIM_PROBLEM`` for the exposure warning.
"""

from __future__ import annotations

import os
import sys

from .cluster.machine.memory import CLIENT_MALLOC_ARENAS
from .cluster.process.containment import PROBLEM_ENV, preload_env


def kernel_command(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The ipykernel command line and environment this launcher execs."""
    env, problem = preload_env(dict(os.environ))
    if problem:
        env[PROBLEM_ENV] = problem
    # glibc reads it at the kernel's start: a kernel has a dozen heaps before its first cell, too late for
    # ``import workbench``'s cap (``memory.cap_malloc_arenas``); a user's own setting stays
    env.setdefault("MALLOC_ARENA_MAX", str(CLIENT_MALLOC_ARENAS))
    # before the first cell: TensorFlow's C++ log lines of the kernel go to a log file from its very first import
    quiet = "--IPKernelApp.exec_lines=__import__('workbench.native_logs').native_logs.route();"
    return [sys.executable, "-m", "ipykernel_launcher", quiet, *argv], env


def main(argv: list[str] | None = None) -> None:
    command, env = kernel_command(sys.argv[1:] if argv is None else argv)
    os.execve(command[0], command, env)


if __name__ == "__main__":
    main()
