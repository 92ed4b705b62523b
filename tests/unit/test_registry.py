import json
import subprocess
import sys

import psutil

from workbench.cluster import registry
from workbench.cluster.registry import ClusterRecord, Endpoint
from workbench.cluster.status import TaskRecord


def _mine(name: str, **extra) -> ClusterRecord:
    me = psutil.Process()
    return ClusterRecord(name=name, state="running", engines="local", owned=True, client_pid=me.pid,
                         client_created=me.create_time(), **extra)


def test_records_round_trip_and_stale_ones_are_pruned(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_REGISTRY_DIR", str(tmp_path))
    task = TaskRecord("worker", 0, 3, "host", "127.0.0.1:5", 42, ["/job:worker/replica:0/task:0/device:CPU:0"], [], "running")
    alive = _mine("alive", spec={"worker": ["127.0.0.1:5"]}, tasks=[task],
                  endpoints={"control": Endpoint("http://127.0.0.1:9", "secret")}, updated=2.0)
    registry.write_record(alive)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    registry.write_record(ClusterRecord(name="stale", state="running", engines="local", owned=True,
                                        client_pid=dead.pid, client_created=1.0))
    assert registry.list_clusters() == [alive]  # read back into the same dataclass, tasks and endpoints included
    assert registry.read_record("alive") == alive and registry.read_record("stale") is None
    assert not (tmp_path / "stale.json").exists()
    assert (tmp_path / "alive.json").stat().st_mode & 0o077 == 0  # it holds a token: this user only
    registry.remove_record("alive")
    assert registry.list_clusters() == []


def test_a_record_written_by_an_older_workbench_is_read(tmp_path, monkeypatch):
    """Version 1 kept the endpoints at the top level, and a task had no 'tensorflow' field."""
    monkeypatch.setenv("WORKBENCH_REGISTRY_DIR", str(tmp_path))
    me = psutil.Process()
    (tmp_path / "old.json").write_text(json.dumps({
        "registry_version": 1, "name": "old", "state": "running", "engines": "slurm", "owned": True,
        "client_pid": me.pid, "client_created": me.create_time(), "spec": {"ps": ["h:1"]},
        "tasks": [{"job": "ps", "index": 0, "engine_id": 0, "host": "h", "address": "h:1", "pid": 7, "devices": [],
                   "gpus": [], "state": "running"}],
        "control": {"url": "http://127.0.0.1:9", "token": "t"}, "dashboard": None, "gpus_per_worker": 0}))
    (record,) = registry.list_clusters()
    assert record.engines == "slurm" and record.tasks[0].name == "ps:0"
    assert record.endpoints == {"control": Endpoint("http://127.0.0.1:9", "t")}


def test_default_location_is_jupyters_runtime_dir(monkeypatch):
    from jupyter_core.paths import jupyter_runtime_dir

    monkeypatch.delenv("WORKBENCH_REGISTRY_DIR")
    assert str(registry.registry_dir()).startswith(jupyter_runtime_dir())
