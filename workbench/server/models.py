"""The JSON the server extension sends to the JupyterLab panel, defined once (a contract test checks it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class TaskInfo:
    name: str  # "worker:0"
    job: str
    index: int
    engine_id: int
    host: str
    address: str
    pid: int
    devices: list[str]
    gpus: list[str]
    state: str  # starting | running | lost | stopped


@dataclass(frozen=True)
class ClusterInfo:
    name: str
    state: str
    engines: str  # the launcher: local, slurm, mpi, ..., existing
    owned: bool  # the workbench started the engines (else it borrowed an existing pool)
    client_pid: int  # the kernel or process that runs the cluster
    tasks: list[TaskInfo]
    dashboard: str | None  # URL of the owner's dashboard server (127.0.0.1), or None
    updated: float
    workbench_version: str = ""
    spec: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> ClusterInfo:
        """A registry record (written by ``Cluster``) -> the panel's view of it."""
        tasks = [TaskInfo(name=f"{t['job']}:{t['index']}", job=t["job"], index=int(t["index"]),
                          engine_id=int(t.get("engine_id", -1)), host=t.get("host", ""), address=t.get("address", ""),
                          pid=int(t.get("pid", 0)), devices=list(t.get("devices", [])), gpus=list(t.get("gpus", [])),
                          state=t.get("state", "")) for t in record.get("tasks", [])]
        dashboard = record.get("dashboard") or None
        return cls(name=record["name"], state=record.get("state", ""), engines=record.get("engines", ""),
                   owned=bool(record.get("owned", False)), client_pid=int(record.get("client_pid", 0)), tasks=tasks,
                   dashboard=dashboard.get("url") if isinstance(dashboard, dict) else None,
                   updated=float(record.get("updated", 0.0)), workbench_version=record.get("workbench_version", ""),
                   spec=dict(record.get("spec", {})))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ErrorBody:
    """Every 4xx answer: what failed, and what to do."""

    error: str
    status: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
