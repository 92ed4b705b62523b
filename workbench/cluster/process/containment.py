"""Keeping TensorFlow's ports off the network: the bind shim, and what each process listens on.

TensorFlow's gRPC servers (ps and worker tasks, the all-reduce group, the profiler service, and a
kernel that becomes a TensorFlow client) bind every interface and authenticate nobody: whoever
reaches a port runs code in that process. TensorFlow has no option to bind one address.

The workbench loads a small library into those processes (``bind_shim.c``, with ``LD_PRELOAD``):
it rewrites a wildcard ``bind()`` to the address in ``$WORKBENCH_BIND_ADDRESS``: the address the
ClusterSpec names for the task (127.0.0.1 on a local cluster, the host's cluster interface
otherwise), loopback when unset, every interface only for ``"*"``. The library is compiled when the
wheel is built (``hatch_build.py``: a Linux platform wheel) and lives next to this module;
``$WORKBENCH_BIND_SHIM`` names another copy (a packager's). Where there is none (not Linux, an
install built without it), the workbench says so and names the open ports (``listeners``, ``exposed``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil

from ...errors import WorkbenchError

BIND_ENV = "WORKBENCH_BIND_ADDRESS"
PROBLEM_ENV = "WORKBENCH_BIND_SHIM_PROBLEM"  # why a process runs without the shim (for the engine's own report)
EVERY_INTERFACE = "*"
SHIM_ENV = "WORKBENCH_BIND_SHIM"  # where the shim is, when not next to this module
SHIM_FILE = Path(__file__).with_name("workbench-bind-shim.so")  # put there by the wheel's build (hatch_build.py)
_SHIM_PREFIX = "workbench-bind-shim"
_WILDCARDS = ("0.0.0.0", "::", "")


class ContainmentError(WorkbenchError):
    """The bind shim is not available here; the message says why and what to do."""


def cache_dir() -> Path:
    """The workbench's per-user files (native logs): ``$WORKBENCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/workbench``,
    else ``~/.cache/workbench``."""
    override = os.environ.get("WORKBENCH_CACHE_DIR")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "workbench"


def shim_path() -> str:
    """The bind shim of this installation; ``ContainmentError`` says why there is none and what to do."""
    if not sys.platform.startswith("linux"):
        raise ContainmentError(f"the bind shim works on Linux only (this is {sys.platform}): TensorFlow's ports listen on "
                               "every interface here; keep them off the network with the host's firewall")
    named = os.environ.get(SHIM_ENV)
    path = Path(named) if named else SHIM_FILE
    if not path.is_file():
        where = f"${SHIM_ENV} names {path}, which does not exist" if named else f"this installation has no {path}"
        raise ContainmentError(f"{where}: the shim is compiled when the package's wheel is built. Install the Linux wheel "
                               "(pip install jupyter-tf-workbench), or reinstall from source with a C compiler "
                               "(Debian/Ubuntu: apt-get install build-essential)")
    return str(path)


def shim_loaded() -> bool:
    """Whether this process runs with the bind shim loaded."""
    try:
        with open("/proc/self/maps") as maps:
            return any(_SHIM_PREFIX in line for line in maps)
    except OSError:
        return False


def preload_env(env: dict[str, str]) -> tuple[dict[str, str], str]:
    """``env`` with the shim in ``LD_PRELOAD`` (and the reason it could not be, or ``""``)."""
    try:
        path = shim_path()
    except ContainmentError as exc:
        return dict(env), str(exc)
    preload = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if _SHIM_PREFIX not in p]
    return {**env, "LD_PRELOAD": " ".join([path, *preload])}, ""


def engine_environment(env: dict[str, str]) -> dict[str, str]:
    """Engines' ``env`` with the shim preloaded, merged with this process's ``LD_PRELOAD``; else with why not."""
    merged, problem = preload_env({"LD_PRELOAD": os.environ.get("LD_PRELOAD", ""), **env})
    if problem:
        merged[PROBLEM_ENV] = f"{problem}; then start the cluster again"
    return merged


def listeners(pid: int | None = None) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket the process listens on."""
    try:
        connections = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return []
    return sorted({(c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN})


def exposed(found: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Those of ``found`` that listen on every interface."""
    return [(ip, port) for ip, port in found if ip in _WILDCARDS]


def describe(address: tuple[str, int]) -> str:
    ip, port = address
    return f"[{ip}]:{port}" if ":" in ip else f"{ip or '*'}:{port}"
