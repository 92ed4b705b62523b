"""Which process a pid names: the one whose create time was read, or a later one that took its pid."""

from __future__ import annotations

import psutil

# psutil's create time adds /proc/stat's btime, whole seconds the kernel derives from the wall clock: two readings
# of one process's can differ by a second when the clock is adjusted between them. A reused pid is younger.
CREATED_SLACK = 2.0


def started_at(proc: psutil.Process, created: float) -> bool:
    """Whether ``proc`` is the process whose create time was read as ``created`` (not a later one with its pid)."""
    return abs(proc.create_time() - created) <= CREATED_SLACK
