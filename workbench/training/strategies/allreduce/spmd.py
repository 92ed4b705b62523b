"""``%%wb spmd`` and ``wb.run_spmd``: a cell run on every worker engine at once, in the all-reduce group."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ....cluster.launch.calls import Deadline
from ....errors import TrainingError
from .group import WorkerGroup

INTERRUPT_GRACE = 30.0  # seconds the workers get to stop an interrupted SPMD cell
OUTPUT_GRACE = 10.0  # seconds a finished cell's printed output may trail its reply (it comes on another channel)


def _wait_for(results: dict, deadline: Deadline) -> bool:
    """Wait until every result is in, or the deadline; in short naps, so that Ctrl-C lands promptly."""
    while not all(r.ready() for r in results.values()):
        if deadline.expired:
            return False
        time.sleep(0.05)
    return True


@dataclass
class WorkerOutput:
    """What one worker printed while running an SPMD cell, and its error (the remote traceback), if any."""

    task: str
    stdout: str
    stderr: str
    error: str | None = None


def run_spmd(cluster, source: str, timeout: float = 600.0) -> list[WorkerOutput]:
    """Run ``source`` on every worker engine at once (SPMD), with the all-reduce group formed.

    The code sees ``strategy`` (a MultiWorkerMirroredStrategy over all workers), ``worker_index``
    and ``num_workers``; ``TF_CONFIG`` is set. Each engine keeps its own namespace between calls.
    Returns each worker's output, in worker order.
    """
    import ipyparallel

    group = WorkerGroup(cluster)
    group.form()
    setup = ("from workbench.training.strategies.allreduce.engine import spmd_names as _wb_spmd_names\n"
             "globals().update(_wb_spmd_names())\ndel _wb_spmd_names")
    group.client[group.engines].execute(setup, block=True)
    running = {e: group.client[e].execute(source, block=False) for e in group.engines}
    try:
        finished = _wait_for(running, Deadline(timeout))
    except KeyboardInterrupt:
        # Ctrl-C in the notebook: interrupt the cell on every worker too, and leave the engines usable.
        group.client.send_signal("SIGINT", targets=group.engines, block=True)
        _wait_for(running, Deadline(INTERRUPT_GRACE))
        unfinished = [group.name(e) for e, r in running.items() if not r.ready()]
        raise TrainingError(
            "the SPMD cell was interrupted on every worker"
            + (f"; {', '.join(unfinished)} did not stop within {INTERRUPT_GRACE:.0f} s (a C++ op, e.g. a collective, "
               "cannot be interrupted: restart the cluster if it stays busy)" if unfinished else "; the cluster is ready for the next cell")
            + ".") from None
    if not finished:
        late = [group.name(e) for e, r in running.items() if not r.ready()]
        raise TrainingError(
            f"the SPMD cell did not finish on {', '.join(late)} within {timeout:.0f} s; it may still run there (an "
            "all-reduce waits for every worker). Interrupt the kernel to stop it, or restart the cluster.")
    outputs = []
    trailing = Deadline(OUTPUT_GRACE)
    for engine, result in running.items():
        result.wait_for_output(trailing.remaining(0.01))  # complete stdout/stderr, or what arrived by then
        error = None
        try:
            result.get(timeout=0)
        except ipyparallel.error.RemoteError as exc:  # the user's exception, with the remote traceback
            error = exc.traceback or f"{exc.ename}: {exc.evalue}"
        outputs.append(WorkerOutput(group.name(engine), result.stdout or "", result.stderr or "", error))
    return outputs
