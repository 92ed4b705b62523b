"""What a batch system says about the job that holds a cluster's engines (for errors that must name it)."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

SLURM_CONFIGS = ("/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf", "/run/slurm/conf/slurm.conf")
QUERY_SECONDS = 10  # a scheduler client that cannot reach its controller retries for about 10 s per call

# per batch system (how its ipyparallel launcher class names begin): the command printing "<state> <reason>" of job {id}
_QUERIES = {
    "slurm": ["squeue", "-h", "-j", "{id}", "-o", "%T %r"],
}


def _query(engine_set: Any) -> list[str] | None:
    """The state query of the launcher's batch system, from its class (``engines="slurm"`` or a full class path)."""
    kind = type(engine_set).__name__.lower()
    return next((query for system, query in _QUERIES.items() if kind.startswith(system)), None)


def job_id(engine_set: Any) -> str:
    """The batch job id an ipyparallel batch launcher recorded when it submitted, or ``""``."""
    return str(getattr(engine_set, "job_id", "") or "")


def job_state(engine_set: Any, job: str) -> str:
    """``"PENDING (reason: Resources)"`` as the scheduler reports it; ``""`` where it cannot be asked."""
    query = _query(engine_set)
    if not job or query is None or shutil.which(query[0]) is None:
        return ""
    try:
        out = subprocess.run([part.format(id=job) for part in query], capture_output=True, text=True,
                             timeout=QUERY_SECONDS).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return ""
    if not out:
        return "no longer in the queue"
    state, reason = out[0], " ".join(out[1:])
    return f"{state} (reason: {reason})" if reason and reason != "None" else state


def describe(engine_set: Any) -> str:
    """A sentence naming the batch job and its state, for an engine start that timed out; ``""`` for non-batch launchers."""
    job = job_id(engine_set)
    if not job:
        return ""
    state = job_state(engine_set, job)
    waiting = state.startswith("PENDING")
    return (f"Batch job {job} is {state or 'in an unknown state'}"
            + ("; the scheduler has not given it what it asks for (nodes, CPUs, time, partition)" if waiting else "")
            + ". It is cancelled as the cluster stops.")


def slurm_reachable() -> str:
    """``""`` when this machine can submit to a Slurm controller that answers (``sinfo``), else why not.

    For a notebook that runs its Slurm cells only where there is a Slurm (tutorial 06).
    """
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "the Slurm commands (sbatch, sinfo) are not installed here"
    configs = [os.environ.get("SLURM_CONF", ""), *SLURM_CONFIGS]
    if not any(path and os.path.exists(path) for path in configs):  # else sinfo would look for one in DNS
        return (f"no Slurm configuration here ({', '.join(SLURM_CONFIGS)}); on a configless site, set SLURM_CONF "
                "to the cached one")
    try:
        result = subprocess.run(["sinfo", "-h", "-o", "%P %a"], capture_output=True, text=True, timeout=QUERY_SECONDS)
    except subprocess.TimeoutExpired:
        return f"sinfo got no answer from the Slurm controller within {QUERY_SECONDS} s"
    except OSError as exc:
        return f"sinfo could not run: {exc}"
    if result.returncode != 0:
        return f"sinfo failed: {result.stderr.strip()[:200] or 'exit status ' + str(result.returncode)}"
    if not any(line.split()[1:2] == ["up"] for line in result.stdout.splitlines() if line.strip()):
        return "the Slurm controller has no partition that is up"
    return ""
