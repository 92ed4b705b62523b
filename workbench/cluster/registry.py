"""Registry of running clusters: one small JSON file per cluster in Jupyter's runtime directory.

Other processes on the machine (the Jupyter server extension, another kernel, the CLI) list
clusters through it. Each file holds one ``ClusterRecord``, written by the cluster's owner and read
back into the same dataclass: this module is the only place that knows the file's layout. A file
is removed on ``stop()``; if its client was killed, the client's reaper removes it, and
``list_clusters`` drops any file whose client process is gone.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import psutil

from .status import TaskRecord

REGISTRY_VERSION = 2


def registry_dir() -> Path:
    """``<jupyter runtime dir>/workbench/clusters`` (``$WORKBENCH_REGISTRY_DIR`` overrides it)."""
    override = os.environ.get("WORKBENCH_REGISTRY_DIR")
    if override:
        return Path(override)
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / "workbench" / "clusters"


def registry_path(name: str) -> Path:
    return registry_dir() / f"{name}.json"


@dataclass(frozen=True)
class Endpoint:
    """Something the owner serves on 127.0.0.1 for other processes: its URL and, if it checks one, a token."""

    url: str
    token: str = ""


@dataclass
class ClusterRecord:
    """What the registry says about one running cluster."""

    name: str
    state: str
    engines: str  # the launcher name the user chose: local, slurm, mpi, ..., existing
    owned: bool  # the workbench started the engines (else it borrowed an existing pool)
    client_pid: int  # the process that runs the cluster (its owner)
    client_created: float  # that process's start time: a reused pid is not the owner
    cluster_file: str = ""  # ipyparallel's cluster file: another process connects through it
    profile_dir: str = ""
    spec: dict[str, list[str]] = field(default_factory=dict)
    tasks: list[TaskRecord] = field(default_factory=list)
    gpus_per_worker: int = 0
    # What higher layers serve for this cluster, by name: "control" (the owner's control endpoint),
    # "dashboard" (its Bokeh apps). The cluster layer stores them without knowing what they are.
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    updated: float = 0.0
    workbench_version: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"registry_version": REGISTRY_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClusterRecord:
        """Read a record written by this or an older workbench (version 1 kept endpoints at the top level)."""
        known = {f.name for f in fields(cls)}
        values = {key: value for key, value in data.items() if key in known}
        endpoints = dict(data.get("endpoints") or {})
        if data.get("registry_version", 1) < 2:
            endpoints = {key: data[key] for key in ("control", "dashboard") if isinstance(data.get(key), dict)}
        values["endpoints"] = {key: Endpoint(str(e.get("url", "")), str(e.get("token", ""))) for key, e in endpoints.items()
                               if isinstance(e, dict) and e.get("url")}
        task_fields = {f.name for f in fields(TaskRecord)}
        values["tasks"] = [TaskRecord(**{k: v for k, v in t.items() if k in task_fields}) for t in data.get("tasks", [])]
        for key, default in (("state", ""), ("engines", ""), ("owned", False), ("client_pid", 0), ("client_created", 0.0)):
            values.setdefault(key, default)
        return cls(**values)

    def client_alive(self) -> bool:
        """Whether the owner process still runs (the same process, not a later one with its pid)."""
        try:
            proc = psutil.Process(int(self.client_pid))
        except (psutil.Error, ValueError):
            return False
        return not self.client_created or abs(proc.create_time() - float(self.client_created)) < 1.0


def write_record(record: ClusterRecord) -> Path:
    """Write (atomically, readable by this user only) the record of ``record.name``."""
    directory = registry_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = registry_path(record.name)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")  # mode 0600: it holds tokens
    with os.fdopen(fd, "w") as handle:
        json.dump(record.to_json(), handle, indent=2, sort_keys=True)
    os.replace(tmp, path)
    return path


def remove_record(name: str) -> None:
    registry_path(name).unlink(missing_ok=True)


def read_record(name: str) -> ClusterRecord | None:
    """The record of the running cluster ``name``, or None."""
    return next((r for r in list_clusters() if r.name == name), None)


def list_clusters(prune: bool = True) -> list[ClusterRecord]:
    """Records of the clusters whose client is alive, sorted by name; stale files are removed."""
    directory = registry_dir()
    if not directory.is_dir():
        return []
    records = []
    for path in sorted(directory.glob("*.json")):
        try:
            record = ClusterRecord.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if record.client_alive():
            records.append(record)
        elif prune:
            path.unlink(missing_ok=True)
    return records
