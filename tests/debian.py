"""Debian packages a test needs, installed with apt-get when missing and the suite runs as root (CI does)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

APT_TIMEOUT = 600


def _found(command: str) -> bool:
    return bool(shutil.which(command)) or Path("/usr/sbin", command).exists()


def ensure(commands: list[str], packages: list[str], what: str) -> str:
    """``""`` when every command is there (installing ``packages`` first if needed and possible), else why not."""
    if all(_found(c) for c in commands):
        return ""
    if os.geteuid() != 0:
        return f"{what} is not installed ({', '.join(packages)}) and installing it needs root (CI runs as root)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]):
        if shutil.which(command[0]) is None:
            return f"{what} is missing and there is no apt-get to install it ({', '.join(packages)})"
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT)
        if result.returncode:
            return f"{what} is missing and `{' '.join(command)}` failed: {result.stderr.strip()[-500:]}"
    missing = [c for c in commands if not _found(c)]
    return f"{what}: {', '.join(missing)} still missing after installing {', '.join(packages)}" if missing else ""
