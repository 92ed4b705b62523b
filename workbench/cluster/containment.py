"""Keeping TensorFlow's ports off the network: the bind shim, and what each process listens on.

TensorFlow's gRPC servers (ps and worker tasks, the all-reduce group, the profiler service, and a
kernel that becomes a TensorFlow client) bind every interface and authenticate nobody: whoever
reaches a port runs code in that process. TensorFlow has no option to bind one address.

The workbench loads a small library into those processes (``bind_shim.c``, with ``LD_PRELOAD``):
it rewrites a wildcard ``bind()`` to the address in ``$WORKBENCH_BIND_ADDRESS``: the address the
ClusterSpec names for the task (127.0.0.1 on a local cluster, the host's cluster interface
otherwise), loopback when unset, every interface only for ``"*"``. The library is compiled on first
use from the package's own C file, into a private cache directory. Where that cannot work (no C
compiler, not Linux), the workbench says so and names the open ports (``listeners``, ``exposed``).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from ..errors import WorkbenchError

BIND_ENV = "WORKBENCH_BIND_ADDRESS"
PROBLEM_ENV = "WORKBENCH_BIND_SHIM_PROBLEM"  # why a process runs without the shim (for the engine's own report)
EVERY_INTERFACE = "*"
SHIM_SOURCE = Path(__file__).with_name("bind_shim.c")
_SHIM_PREFIX = "workbench-bind-shim-"
_BUILD_TIMEOUT = 120.0
_WILDCARDS = ("0.0.0.0", "::", "")


class ContainmentError(WorkbenchError):
    """The bind shim is not available here; the message says why and what to do."""


def cache_dir() -> Path:
    """Where the compiled shim lives: ``$WORKBENCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/workbench``, else ``~/.cache/workbench``."""
    override = os.environ.get("WORKBENCH_CACHE_DIR")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "workbench"


def _shim_name() -> str:
    digest = hashlib.sha256(SHIM_SOURCE.read_bytes()).hexdigest()[:12]
    return f"{_SHIM_PREFIX}{digest}-{platform.machine()}.so"


def shim_path() -> str:
    """The shim compiled for this machine, built on first use; ``ContainmentError`` says why not."""
    if not sys.platform.startswith("linux"):
        raise ContainmentError(f"the bind shim works on Linux only (this is {sys.platform})")
    directory = cache_dir()
    target = directory / _shim_name()
    if target.exists():
        return str(target)
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise ContainmentError("there is no C compiler to build the bind shim: install one (Debian/Ubuntu: "
                               "apt-get install build-essential; conda: conda install c-compiler)")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=directory, prefix=".build-", suffix=".so")
    os.close(fd)
    command = [compiler, "-shared", "-fPIC", "-O2", "-o", partial, str(SHIM_SOURCE), "-ldl"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=_BUILD_TIMEOUT)
        if result.returncode != 0:
            raise ContainmentError(f"building the bind shim failed ({' '.join(command)}): "
                                   f"{(result.stderr or result.stdout).strip()[-500:]}")
        os.replace(partial, target)  # atomic: processes building at once all end with a whole file
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ContainmentError(f"building the bind shim with {compiler} failed: {exc}") from None
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return str(target)


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
