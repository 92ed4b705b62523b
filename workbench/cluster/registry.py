"""Registry of running clusters: one small JSON file per cluster in Jupyter's runtime directory.

Other processes on the machine (the Jupyter server extension, another kernel, the CLI) list
clusters through it. Each file holds one ``ClusterRecord``, written by the cluster's owner and read
back into the same dataclass: this module is the only place that knows the file's layout. A file
is removed on ``stop()``; if its client was killed, the client's reaper removes it, and
``list_clusters`` drops any file whose client process is gone.

A record holds the owner's control token, and the Jupyter server acts on what records say: files
are written 0600 into a 0700 directory, and a file that is not this user's, or that others could
write, is not read (nor removed: it is not ours to delete). Neither is one that is not a record:
corrupt, partial or hostile JSON is skipped, whatever it holds.
"""

from __future__ import annotations

import json
import os
import tempfile
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from ..tables import html_table, text_table
from .machine.processes import started_at
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
    token: str = field(default="", repr=False)  # kept out of a cell's output (``wb.list_clusters()``) and the notebook

    def request(self, method: str, op: str, body: dict | None = None, timeout: float = 30.0) -> Any:
        """``method`` ``<url>/<op>`` with the token and a JSON body; the JSON answer. ``urllib`` errors propagate."""
        request = urllib.request.Request(f"{self.url}/{op}", method=method,
                                         data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read() or b"null")


@dataclass(repr=False)
class ClusterRecord:
    """What the registry says about one running cluster (its repr is one line; ``list_clusters`` shows a table)."""

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
    network: str = ""  # the emulated links and their shaping (Cluster.network), "" without network=
    updated: float = 0.0
    workbench_version: str = ""
    job: str = ""  # the owner's job running now (set-up included), "" when none: the panel follows it closely

    def __repr__(self) -> str:
        return f"<ClusterRecord {self.name!r} {self.state}: {_tasks_of(self)}; engines={self.engines!r}, owner pid {self.client_pid}>"

    def to_json(self) -> dict[str, Any]:
        return {"registry_version": REGISTRY_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: Any) -> ClusterRecord:
        """Read a record written by this or an older workbench (version 1 kept endpoints at the top level).

        Anything that is not one (a field of the wrong type, a missing name) raises ``ValueError``.
        """
        _expect(data, dict, "record")
        values = {key: _checked(key, value, _RECORD_TYPES) for key, value in data.items() if key in _RECORD_TYPES}
        if not values.get("name"):
            raise ValueError("a record names its cluster")
        endpoints = data.get("endpoints") or {}
        if data.get("registry_version", 1) == 1:
            endpoints = {key: data[key] for key in ("control", "dashboard") if isinstance(data.get(key), dict)}
        _expect(endpoints, dict, "endpoints")
        values["endpoints"] = {str(key): Endpoint(_checked("url", e.get("url"), {"url": str}),
                                                  _checked("token", e.get("token", ""), {"token": str}))
                               for key, e in endpoints.items() if _expect(e, dict, "endpoint") and e.get("url")}
        values["tasks"] = [TaskRecord(**{k: _checked(k, v, _TASK_TYPES) for k, v in _expect(t, dict, "task").items()
                                         if k in _TASK_TYPES}) for t in _expect(data.get("tasks", []), list, "tasks")]
        for key, default in (("state", ""), ("engines", ""), ("owned", False), ("client_pid", 0), ("client_created", 0.0)):
            values.setdefault(key, default)
        return cls(**values)

    def client_alive(self) -> bool:
        """Whether the owner process still runs (the same process, not a later one with its pid)."""
        try:
            proc = psutil.Process(int(self.client_pid))
        except (psutil.Error, ValueError):
            return False
        return not self.client_created or started_at(proc, float(self.client_created))


def _tasks_of(record: ClusterRecord) -> str:
    return ", ".join(f"{t.name}@{t.address}" if t.address else t.name for t in record.tasks) or "no tasks"


class ClusterRecords(list):
    """What ``list_clusters`` returns: a list of ``ClusterRecord`` that shows as one table (a cell, a terminal, the
    ``jupyter-tf-workbench list`` command)."""

    COLUMNS = ("cluster", "state", "tasks", "engines", "job", "owner pid")

    def rows(self) -> list[tuple[str, ...]]:
        return [(r.name, r.state, _tasks_of(r), r.engines if r.owned else f"{r.engines} (borrowed)", r.job or "-",
                 str(r.client_pid)) for r in self]

    def __repr__(self) -> str:
        return text_table(self.COLUMNS, self.rows()) if self else "no running workbench clusters"

    def _repr_html_(self) -> str:
        return html_table(self.COLUMNS, self.rows()) if self else "<p>no running workbench clusters</p>"


def _private_dir() -> Path:
    """The registry directory, made (or made again) this user's alone."""
    directory = registry_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if directory.stat().st_uid == os.getuid() and directory.stat().st_mode & 0o077:
        directory.chmod(0o700)
    return directory


def _trusted(path: Path) -> bool:
    """A file this user owns and nobody else can write."""
    try:
        info = path.stat()
    except OSError:
        return False
    return info.st_uid == os.getuid() and not info.st_mode & 0o022


def _expect(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{what} is a {type(value).__name__}, not a {kind.__name__}")
    return value


def _checked(key: str, value: Any, types: dict[str, Any]) -> Any:
    """``value`` if it has the type ``types[key]`` says (lists and dicts of strings checked inside), else ValueError."""
    kind = types[key]
    if kind == "strings":
        return [_expect(item, str, key) for item in _expect(value, list, key)]
    if kind == "spec":
        return {_expect(job, str, key): [_expect(a, str, key) for a in _expect(addresses, list, key)]
                for job, addresses in _expect(value, dict, key).items()}
    if kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key} is not a number")
        return float(value)
    return _expect(value, kind, key)


_RECORD_TYPES: dict[str, Any] = {
    "name": str, "state": str, "engines": str, "owned": bool, "client_pid": int, "client_created": "number",
    "cluster_file": str, "profile_dir": str, "spec": "spec", "gpus_per_worker": int, "updated": "number",
    "workbench_version": str, "network": str, "job": str}
_TASK_TYPES: dict[str, Any] = {
    "job": str, "index": int, "engine_id": int, "host": str, "address": str, "pid": int, "devices": "strings",
    "gpus": "strings", "state": str, "tensorflow": str, "since": "number", "note": str, "restarts": int}


def write_record(record: ClusterRecord) -> Path:
    """Write (atomically, readable by this user only) the record of ``record.name``."""
    directory = _private_dir()
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


def endpoint(name: str, kind: str) -> Endpoint | None:
    """What cluster ``name``'s owner serves as ``kind`` (``"control"``, ...), from its record; None if nothing."""
    record = read_record(name)
    return record.endpoints.get(kind) if record is not None else None


def list_clusters(prune: bool = True) -> ClusterRecords:
    """Records of the clusters whose client is alive, sorted by name (a list, shown as a table); stale files are
    removed."""
    directory = registry_dir()
    records = ClusterRecords()
    if not directory.is_dir():
        return records
    for path in sorted(directory.glob("*.json")):
        if not _trusted(path):
            continue
        try:
            record = ClusterRecord.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, RecursionError):  # not a record: skipped, left alone
            continue
        if record.name != path.stem:  # a record speaks for the cluster its file is named after, or not at all
            continue
        if record.client_alive():
            records.append(record)
        elif prune:
            path.unlink(missing_ok=True)
    return records
