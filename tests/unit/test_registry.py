import subprocess
import sys

import psutil

from workbench.cluster import registry


def test_records_round_trip_and_stale_ones_are_pruned(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_REGISTRY_DIR", str(tmp_path))
    me = psutil.Process()
    registry.write_record({"name": "alive", "client_pid": me.pid, "client_created": me.create_time(), "tasks": []})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    registry.write_record({"name": "stale", "client_pid": dead.pid, "client_created": 1.0, "tasks": []})
    names = [r["name"] for r in registry.list_clusters()]
    assert names == ["alive"]
    assert not (tmp_path / "stale.json").exists()
    registry.remove_record("alive")
    assert registry.list_clusters() == []


def test_default_location_is_jupyters_runtime_dir(monkeypatch):
    from jupyter_core.paths import jupyter_runtime_dir

    monkeypatch.delenv("WORKBENCH_REGISTRY_DIR")
    assert str(registry.registry_dir()).startswith(jupyter_runtime_dir())
