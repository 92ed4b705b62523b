"""Which process a pid names: the one whose create time was read, or a later one that took its pid."""

from __future__ import annotations

from collections.abc import Iterable

import psutil

# psutil's create time adds /proc/stat's btime, whole seconds the kernel derives from the wall clock: two readings
# of one process's can differ by a second when the clock is adjusted between them. A reused pid is younger.
CREATED_SLACK = 2.0


def started_at(proc: psutil.Process, created: float) -> bool:
    """Whether ``proc`` is the process whose create time was read as ``created`` (not a later one with its pid)."""
    return abs(proc.create_time() - created) <= CREATED_SLACK


def find_process(pid: int, created: float | None = None) -> psutil.Process | None:
    """The process ``pid`` names, if it runs and (given ``created``) is the one whose create time was read then.

    Never a thread: Linux gives threads ids from the same numbers as processes, ``psutil.Process`` accepts a
    thread's id, and a signal sent to it reaches the whole process the thread belongs to. A dead engine's pid
    taken by one of the client's own threads would otherwise make "kill that engine" end the client.
    """
    if pid <= 0 or not psutil.pid_exists(pid):  # psutil's pid_exists is False for the id of a thread
        return None
    try:
        proc = psutil.Process(pid)
        if created is not None and not started_at(proc, created):
            return None
    except psutil.Error:
        return None
    return proc


def process_trees(pids: Iterable[tuple[int, float]]) -> list[psutil.Process]:
    """Each ``(pid, create time)`` that still names its process (``find_process``; 0: no create time known), and
    its descendants, once each."""
    procs: dict[int, psutil.Process] = {}
    for pid, created in pids:
        proc = find_process(pid, created or None)
        if proc is None:
            continue
        try:
            for member in [proc, *proc.children(recursive=True)]:
                procs[member.pid] = member
        except psutil.Error:
            continue
    return list(procs.values())
