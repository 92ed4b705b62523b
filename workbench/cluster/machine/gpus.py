"""Which GPUs a host offers, and which of them each task may see.

Assignment is pure (unit-tested); discovery reads the environment and the NVIDIA driver
without importing TensorFlow, because ``CUDA_VISIBLE_DEVICES`` must be set before TF loads.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from collections.abc import Mapping, MutableMapping, Sequence
from typing import TypeVar

from ...errors import ConfigurationError

Task = TypeVar("Task")  # a task id with ``job`` ("ps"/"worker"), sortable: ``cluster.spec.TaskId``

# The engine bootstrap hides GPUs early for CPU-only pools; it keeps what it hid here.
ORIGINAL_VISIBLE_ENV = "WORKBENCH_ORIGINAL_CUDA_VISIBLE_DEVICES"


# Read by TensorFlow when it sets up a process's GPUs (its first op): "true" makes each GPU's memory grow as ops need it
GROWTH_ENV = "TF_FORCE_GPU_ALLOW_GROWTH"


def let_kernel_memory_grow(environ: MutableMapping[str, str] | None = None) -> None:
    """Make this process's TensorFlow take GPU memory as its ops need it, unless the user chose (``GROWTH_ENV`` set).

    The kernel runs nothing of its own on a GPU (the work runs on the tasks), but TensorFlow's default reserves nearly
    all of a GPU at the process's first allocation there, and a Keras optimizer or model made in a cell is one: workers
    on this machine given that GPU were then left ~2 GB of an H200's 140 and ran out of memory (bench/gpu.py, ResNet-50).
    Called when the workbench is imported, i.e. before the user's first op in the usual notebook; engines started from
    the kernel inherit it (a worker's memory then grows too, to all of its GPU if its steps need it).
    """
    environ = os.environ if environ is None else environ
    environ.setdefault(GROWTH_ENV, "true")


def parse_visible_devices(value: str | None) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as a list of ids; ``None`` when the variable is unset."""
    if value is None:
        return None
    ids = [part.strip() for part in value.split(",") if part.strip()]
    # CUDA stops at the first invalid entry; "-1" is the usual way to hide every GPU.
    visible: list[str] = []
    for part in ids:
        if part.startswith("-"):
            break
        visible.append(part)
    return visible


def discover_gpus(environ: Mapping[str, str] | None = None) -> list[str]:
    """GPU ids this process may use: the schedulers' ``CUDA_VISIBLE_DEVICES`` if set, else the driver's list."""
    environ = os.environ if environ is None else environ
    for key in (ORIGINAL_VISIBLE_ENV, "CUDA_VISIBLE_DEVICES"):
        visible = parse_visible_devices(environ.get(key))
        if visible is not None:
            return visible
    return [str(i) for i in range(_count_driver_gpus())]


def _count_driver_gpus() -> int:
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=15, check=False)
            return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.SubprocessError):
            pass
    return len(glob.glob("/proc/driver/nvidia/gpus/*"))


def validate_gpus_per_worker(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(
            f"gpus_per_worker={value!r} is not allowed: pass a whole number >= 0 (0 runs on CPUs only)."
        )
    return value


def assign_gpus(
    tasks_by_host: Mapping[str, Sequence[Task]],
    available: Mapping[str, Sequence[str]],
    gpus_per_worker: int,
    in_use: Mapping[str, Sequence[str]] | None = None,
) -> dict[Task, list[str]]:
    """Give each worker ``gpus_per_worker`` GPUs of its host, disjoint from every other task there.

    ps tasks get none. ``in_use`` holds GPUs already given to running tasks (when scaling).
    Raises ``ConfigurationError`` when a host has too few GPUs.
    """
    in_use = in_use or {}
    assignment: dict[Task, list[str]] = {}
    for host, tasks in tasks_by_host.items():
        taken = set(in_use.get(host, ()))
        free = [gpu for gpu in available.get(host, ()) if gpu not in taken]
        workers = sorted(t for t in tasks if t.job == "worker")
        needed = len(workers) * gpus_per_worker
        if needed > len(free):
            raise ConfigurationError(
                f"host {host!r} has {len(free)} free GPU(s) {free} but its {len(workers)} worker task(s) "
                f"need {gpus_per_worker} each ({needed} in all): lower gpus_per_worker, run fewer "
                "workers per host, or use a host with more GPUs."
            )
        for i, task in enumerate(workers):
            assignment[task] = free[i * gpus_per_worker:(i + 1) * gpus_per_worker]
        for task in tasks:
            assignment.setdefault(task, [])
    return assignment
