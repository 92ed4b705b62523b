"""Pure building of TensorFlow cluster descriptions: task names, roles, ClusterSpec, TF_CONFIG.

Nothing here touches the network or imports TensorFlow, so it is unit-tested on its own.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from ..errors import ConfigurationError, UnknownTaskError

JOBS = ("ps", "worker")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # a cluster's name
_TASK_RE = re.compile(r"^\s*(?:/job:)?(ps|worker)\s*[:/]\s*(?:task:)?(\d+)\s*$")


@dataclass(frozen=True, order=True)
class TaskId:
    """One TensorFlow task: a job name and an index, written ``"worker:1"``."""

    job: str
    index: int

    def __str__(self) -> str:
        return f"{self.job}:{self.index}"

    @property
    def device(self) -> str:
        """The TensorFlow device prefix of this task, e.g. ``/job:worker/replica:0/task:1``."""
        return f"/job:{self.job}/replica:0/task:{self.index}"

    @classmethod
    def parse(cls, text: str | TaskId) -> TaskId:
        """Parse ``"worker:1"``, ``"ps/0"`` or ``"/job:worker/task:1"``."""
        if isinstance(text, TaskId):
            return text
        match = _TASK_RE.match(str(text))
        if not match:
            raise UnknownTaskError(
                f"{text!r} is not a task name: write it as 'ps:0' or 'worker:1' "
                "(job 'ps' or 'worker', a colon, the task index)."
            )
        return cls(match.group(1), int(match.group(2)))


def validate_name(name: str | None) -> str:
    """A cluster's name: the one given, checked, or ``wb-`` and six random letters."""
    if name is None:
        return "wb-" + "".join(secrets.choice("abcdefghijkmnpqrstuvwxyz23456789") for _ in range(6))
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigurationError(
            f"name={name!r} is not a valid cluster name: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit."
        )
    return name


def validate_timeout(seconds: object, name: str = "start_timeout") -> float:
    """A timeout argument (``start_timeout=`` by default): a positive number of seconds."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds <= 0:
        raise ConfigurationError(f"{name}={seconds!r} must be a positive number of seconds.")
    return float(seconds)


def role_layout(ps: int, workers: int) -> list[TaskId]:
    """The tasks of a cluster in engine order: every ps task first, then the workers."""
    validate_counts(ps, workers)
    return [TaskId("ps", i) for i in range(ps)] + [TaskId("worker", i) for i in range(workers)]


def validate_counts(ps: object, workers: object) -> None:
    """Reject task counts that cannot make a cluster, saying what to change."""
    for name, value, minimum in (("ps", ps, 0), ("workers", workers, 1)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigurationError(
                f"{name}={value!r} is not a whole number: pass an int, e.g. {name}={max(minimum, 1)}."
            )
        if value < minimum:
            hint = "use ps=0 for a cluster without parameter servers" if name == "ps" else (
                "a cluster needs at least one worker: use workers=1 or more"
            )
            raise ConfigurationError(f"{name}={value} is not allowed: {hint}.")


def cluster_spec_dict(addresses: dict[TaskId, str]) -> dict[str, list[str]]:
    """The ``{"ps": [...], "worker": [...]}`` mapping for ``tf.train.ClusterSpec``.

    Indices of each job must run 0..n-1 without gaps; jobs without tasks are left out.
    """
    spec: dict[str, list[str]] = {}
    for job in JOBS:
        indices = sorted(t.index for t in addresses if t.job == job)
        if indices != list(range(len(indices))):
            raise ValueError(f"{job} task indices must be 0..{len(indices) - 1}, got {indices}")
        if indices:
            spec[job] = [addresses[TaskId(job, i)] for i in indices]
    return spec


def tf_config(spec: dict[str, list[str]], task: TaskId) -> str:
    """The ``TF_CONFIG`` JSON that tells the process at ``task`` who it is in ``spec``."""
    if task.job not in spec or task.index >= len(spec[task.job]):
        raise UnknownTaskError(f"{task} is not part of the cluster {spec}")
    return json.dumps({"cluster": spec, "task": {"type": task.job, "index": task.index}})
