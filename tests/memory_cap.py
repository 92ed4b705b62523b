"""A memory cgroup with a hard limit, like the one mybinder.org puts a session in (2 GB), for tests run as root.

``MemoryCap.create(limit)`` makes a child of this process's own memory cgroup (cgroup v2 where the
unified hierarchy has the memory controller, else v1), sets the limit and no swap. Processes join it
through ``command(...)``: a wrapper that writes its own pid into the cgroup, then execs the real
command, so everything that command starts (a kernel's engines, a server's kernels) is held to the
limit too. ``peak()``, ``in_use()`` and ``oom_kills()`` say what happened; ``remove()`` kills what is left and
removes the cgroup.

    python tests/memory_cap.py CGROUP_DIR COMMAND [ARGS...]   # join, then exec COMMAND
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

MOUNT = Path("/sys/fs/cgroup")


def _own_path(v1: bool) -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (v1 and "memory" in controllers.split(",")) or (not v1 and controllers == ""):
            return path.strip("/")
    return ""


def _read_key(path: Path, key: str) -> int:
    for line in path.read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


@dataclass
class MemoryCap:
    directory: Path
    v2: bool
    limit: int

    @classmethod
    def available(cls) -> str:
        """Why a cap cannot be made here, or ``""``."""
        if os.geteuid() != 0:
            return "making a memory cgroup needs root (CI runs as root)"
        if not ((MOUNT / "cgroup.controllers").exists() or (MOUNT / "memory" / "cgroup.procs").exists()):
            return f"no cgroup memory controller is mounted under {MOUNT}"
        return ""

    @classmethod
    def create(cls, limit: int) -> MemoryCap:
        v2 = "memory" in ((MOUNT / "cgroup.controllers").read_text().split() if (MOUNT / "cgroup.controllers").exists() else [])
        base = MOUNT if v2 else MOUNT / "memory"
        directory = base / _own_path(v1=not v2) / f"wb-test-{uuid.uuid4().hex[:8]}"
        directory.mkdir()
        cap = cls(directory, v2, limit)
        if v2:
            (directory / "memory.max").write_text(str(limit))
            if (directory / "memory.swap.max").exists():
                (directory / "memory.swap.max").write_text("0")
        else:
            (directory / "memory.limit_in_bytes").write_text(str(limit))
            if (directory / "memory.memsw.limit_in_bytes").exists():  # no swap either (the kernel may lack swap accounting)
                (directory / "memory.memsw.limit_in_bytes").write_text(str(limit))
        return cap

    def command(self, *argv: str) -> list[str]:
        """``argv`` run inside this cgroup (with its descendants)."""
        return [sys.executable, str(Path(__file__).resolve()), str(self.directory), *argv]

    def pids(self) -> list[int]:
        return [int(p) for p in (self.directory / "cgroup.procs").read_text().split()]

    def peak(self) -> int:
        """The most memory the cgroup held at once (bytes; page cache included, as the limit counts it)."""
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        path = self.directory / name
        return int(path.read_text()) if path.exists() else 0

    def in_use(self) -> dict[str, int]:
        """Bytes the cgroup's processes hold now: anonymous memory, and file pages they have mapped.

        Unlike ``peak()`` this leaves out page cache that is only cached: the kernel reclaims that
        before it kills anything, so a peak at the limit alone means little.
        """
        stat = self.directory / "memory.stat"
        if self.v2:
            return {"anon": _read_key(stat, "anon"), "mapped_file": _read_key(stat, "file_mapped")}
        return {"anon": _read_key(stat, "total_rss"), "mapped_file": _read_key(stat, "total_mapped_file")}

    def reset_peak(self) -> bool:
        """Start the peak over from now (cgroup v1 allows it; v2 keeps one peak for the cgroup's life)."""
        if self.v2:
            return False
        (self.directory / "memory.max_usage_in_bytes").write_text("0")
        return True

    def oom_kills(self) -> int:
        """How many processes the kernel killed in this cgroup for running out of memory."""
        if self.v2:
            return _read_key(self.directory / "memory.events", "oom_kill")
        return _read_key(self.directory / "memory.oom_control", "oom_kill")

    def remove(self, timeout: float = 30.0) -> None:
        """Kill whatever still runs inside (it should be nothing), then remove the cgroup."""
        deadline = time.monotonic() + timeout
        while self.pids() and time.monotonic() < deadline:
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        while time.monotonic() < deadline:
            try:
                self.directory.rmdir()
                return
            except OSError:  # the last processes are still being reaped
                time.sleep(0.2)
        self.directory.rmdir()


def main() -> None:
    directory, *argv = sys.argv[1:]
    Path(directory, "cgroup.procs").write_text(str(os.getpid()))
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
