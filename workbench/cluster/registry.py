"""Registry of running clusters: one small JSON file per cluster in Jupyter's runtime directory.

Other processes on the machine (the Jupyter server extension, another kernel, the CLI) list
clusters through it. A file is removed on ``stop()``; if its client was killed, the client's
reaper removes it, and ``list_clusters`` drops any file whose client process is gone.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import psutil

REGISTRY_VERSION = 1


def registry_dir() -> Path:
    """``<jupyter runtime dir>/workbench/clusters`` (``$WORKBENCH_REGISTRY_DIR`` overrides it)."""
    override = os.environ.get("WORKBENCH_REGISTRY_DIR")
    if override:
        return Path(override)
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / "workbench" / "clusters"


def registry_path(name: str) -> Path:
    return registry_dir() / f"{name}.json"


def write_record(record: dict[str, Any]) -> Path:
    """Write (atomically) the record of the cluster ``record["name"]``."""
    directory = registry_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = registry_path(record["name"])
    payload = {"registry_version": REGISTRY_VERSION, **record}
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True)
    os.replace(tmp, path)
    return path


def remove_record(name: str) -> None:
    registry_path(name).unlink(missing_ok=True)


def _client_alive(record: dict[str, Any]) -> bool:
    pid = record.get("client_pid")
    if not isinstance(pid, int):
        return False
    try:
        proc = psutil.Process(pid)
    except psutil.Error:
        return False
    created = record.get("client_created")
    return not created or abs(proc.create_time() - float(created)) < 1.0


def list_clusters(prune: bool = True) -> list[dict[str, Any]]:
    """Records of the clusters whose client is alive, sorted by name; stale files are removed."""
    directory = registry_dir()
    if not directory.is_dir():
        return []
    records = []
    for path in sorted(directory.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _client_alive(record):
            records.append(record)
        elif prune:
            path.unlink(missing_ok=True)
    return records
