"""Memory that local engines need, against what this machine, or the container it runs in, has left.

Local engines are forked from one warm process that imported TensorFlow: the memory it holds, shared
with every fork, costs ``WARM_BYTES`` once (measured 430-480 MiB of PSS for the warm process and its
forks beyond their own pages), and each engine ``FORKED_ENGINE_BYTES``: its own pages (USS 75 MiB at
start, 90-100 after ps training, 160-180 for an all-reduce worker, which runs a second gRPC server)
and its nanny's (6 MiB). An engine started as a new process (no fork) imports TensorFlow itself:
``ENGINE_BYTES``. Figures from ``bench/tutorial_memory.py`` (TF 2.21 on CPU). A container (Binder,
Docker, a batch job's cgroup) can have far less memory than its host, and its limit is what the
kernel enforces, by killing the largest process.

A process's own heap: ``trim_memory`` gives what it freed back to the system, ``cap_malloc_arenas`` keeps its
threads to two heaps (``import workbench`` calls it), ``malloc_arenas`` counts them, ``keep_large_blocks_in_heap``
undoes TensorFlow's process-wide cap on the size of a heap block.
"""

from __future__ import annotations

import ctypes
import os
import re
import tempfile
from pathlib import Path

import psutil

MiB = 2**20
GiB = 2**30
ENGINE_BYTES = 420 * MiB
WARM_BYTES = 450 * MiB
FORKED_ENGINE_BYTES = 160 * MiB
# A TensorFlow client's heap arenas (glibc's default: 8 per core, one per thread up to that): bench/soak.py
CLIENT_MALLOC_ARENAS = 2
M_ARENA_MAX = -8  # glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's own ceiling for the block size it serves from a heap rather than a mapping of its own (64-bit), up to which
# its default raises the threshold as blocks are freed; the free top of a heap kept, twice that, as glibc's default
LARGE_BLOCK_BYTES = 32 * MiB
GLIBC_ARENA_TEST = 8  # heaps after which glibc fixes its limit (64-bit): a later M_ARENA_MAX changes nothing
CGROUP_MOUNT = Path("/sys/fs/cgroup")
# (directory under the mount, limit, usage, memory.stat key of reclaimable page cache): cgroup v2, then v1
_LAYOUTS = (("", "memory.max", "memory.current", "inactive_file"),
            ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2 unlimited) reads as None


def _reclaimable(stat_file: Path, key: str) -> int:
    try:
        for line in stat_file.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _own_cgroup(proc_cgroup: str, v1: bool) -> str:
    """This process's cgroup path from ``/proc/self/cgroup`` ("4:memory:/a/b" in v1, "0::/a/b" in v2)."""
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if (v1 and "memory" in controllers.split(",")) or (not v1 and controllers == ""):
            return path
    return "/"


def container_available(mount: Path = CGROUP_MOUNT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """Bytes left under the tightest cgroup memory limit on this process's cgroup path; None if unlimited.

    Reclaimable page cache counts as free. In a container with its own cgroup namespace the path is
    "/" and the mount shows the container's own cgroup; on a host (a batch job's cgroup) the limit
    sits on the process's path under the mount, or on one of its parents.
    """
    try:
        own = proc_cgroup.read_text()
    except OSError:
        own = ""
    for subdir, limit_name, usage_name, cache_key in _LAYOUTS:
        base = mount / subdir
        if not (base / usage_name).exists() and not (base / "cgroup.procs").exists():
            continue
        directory = base / _own_cgroup(own, v1=bool(subdir)).strip("/")
        tightest = None
        for level in (directory, *directory.parents):
            limit, usage = _read_int(level / limit_name), _read_int(level / usage_name)
            if limit is not None and usage is not None and limit < 2**60:  # v1 says "unlimited" with a huge number
                left = max(limit - usage + _reclaimable(level / "memory.stat", cache_key), 0)
                tightest = left if tightest is None else min(tightest, left)
            if level == base:
                break
        return tightest
    return None


def available_memory() -> tuple[int, str]:
    """Bytes new processes can still use here, and where that limit comes from ("machine" or "container")."""
    machine = psutil.virtual_memory().available
    container = container_available()
    if container is not None and container < machine:
        return container, "container"
    return machine, "machine"


def engines_need(engines: int, forked: bool = True, with_warm: bool = True) -> int:
    """Bytes that ``engines`` more local engines need: forks of a warm process (started now if ``with_warm``) or not."""
    if not forked:
        return engines * ENGINE_BYTES
    return engines * FORKED_ENGINE_BYTES + (WARM_BYTES if with_warm else 0)


def engine_memory_warning(engines: int, available: int, where: str = "machine", forked: bool = True,
                          with_warm: bool = True) -> str | None:
    """The warning for starting ``engines`` more engines with ``available`` bytes left, or None if they fit."""
    needed = engines_need(engines, forked, with_warm)
    if engines <= 0 or needed <= available:
        return None
    if forked:
        how = (f"{FORKED_ENGINE_BYTES / MiB:.0f} MiB each, forked from a process that imported TensorFlow"
               + (f", which takes {WARM_BYTES / MiB:.0f} MiB" if with_warm else ""))
    else:
        how = f"each imports TensorFlow: about {ENGINE_BYTES / MiB:.0f} MiB"
    return (f"starting {engines} engine(s) needs about {needed / GiB:.1f} GiB ({how}), but this {where} has "
            f"{available / GiB:.1f} GiB free. The system may kill engines or this kernel when memory runs out. Start "
            "fewer tasks, stop other clusters or kernels, or run where there is more memory (engines=... on a cluster).")


def trim_memory() -> bool:
    """Give the memory this process has freed back to the system; False where that is not possible.

    glibc keeps freed heap memory for reuse. After a profile capture an engine holds about 100 MiB
    of freed trace buffers that way (measured: 201 -> 104 MiB USS), and a memory-capped container
    (Binder) counts it all. Elsewhere (musl, macOS) there is no ``malloc_trim``: nothing to do.
    """
    malloc_trim = _glibc("malloc_trim")
    return malloc_trim is not None and bool(malloc_trim(0))


def cap_malloc_arenas(arenas: int = CLIENT_MALLOC_ARENAS) -> bool:
    """Have glibc's allocator share at most ``arenas`` heaps between this process's threads from now on; False
    where it was not changed: ``MALLOC_ARENA_MAX`` set in the environment (the user's choice, which glibc read at
    start), or no glibc (musl, macOS).

    A TensorFlow client runs a hundred and more native threads (gRPC's, the eager executors'), and glibc gives
    threads heaps of their own up to 8 per core. Each heap keeps its own freed, fragmented memory, so a kernel
    grew by about a third of a MiB a job; with two heaps, by 0.15, and no job ran slower (``bench/soak.py``; the
    benchmarks page). Heaps made before the call stay in use, and once a process has more than 8, glibc has fixed
    its limit for good: a Jupyter kernel has a dozen before its first cell, so the workbench's kernel and ``make
    lab`` set ``MALLOC_ARENA_MAX`` before the kernel starts instead.
    """
    if "MALLOC_ARENA_MAX" in os.environ or (malloc_arenas() or 0) > GLIBC_ARENA_TEST:
        return False
    mallopt = _glibc("mallopt")
    return mallopt is not None and bool(mallopt(M_ARENA_MAX, arenas))


def keep_large_blocks_in_heap() -> bool:
    """Serve blocks of up to 32 MiB from the heap again, as glibc's default does once such blocks were freed; False
    where that is not possible (no glibc).

    The first time a process makes TensorFlow's ``GeneratorDataset`` kernel (``Dataset.from_generator``, and every
    ``tf.distribute`` strategy's per-device input: ``MultiDeviceIterator``), TensorFlow sets glibc's mmap threshold to
    128 KiB for good (its mitigation of a Python 3.11 leak), which also ends glibc's raising of it. From then on every
    tensor over 128 KiB is a mapping of its own, made and unmapped each time, its pages faulted in afresh: on a
    worker that had run an all-reduce job, a CNN's sync-ps steps took 1.4 times as long (400,000 page faults a job
    against 30,000, measured with ``/proc``, the calls seen with ``strace`` and ``gdb``). TensorFlow does it once per
    process: called after that (an all-reduce worker makes it happen as it joins its group:
    ``compat.tensorflow.generator_malloc_setting_now``), this holds for the process's life. The heap's free blocks go
    back to the system after each job all the same (``trim_memory``).
    """
    mallopt = _glibc("mallopt")
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES)) \
        and bool(mallopt(M_TRIM_THRESHOLD, 2 * LARGE_BLOCK_BYTES))


def _glibc(name: str):
    """glibc's function ``name`` in this process, or None where there is none (musl, macOS)."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


def malloc_arenas() -> int | None:
    """How many heaps glibc's allocator has made in this process (``malloc_info``), or None without glibc."""
    libc = ctypes.CDLL(None)
    try:
        malloc_info, fopen, fclose = libc.malloc_info, libc.fopen, libc.fclose
    except AttributeError:
        return None
    fopen.restype, fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
    malloc_info.argtypes, fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
    with tempfile.NamedTemporaryFile("r", suffix=".xml") as report:
        stream = fopen(report.name.encode(), b"w")
        if not stream:
            return None
        malloc_info(0, stream)
        fclose(stream)
        return len(re.findall(r"<heap nr=", report.read()))
