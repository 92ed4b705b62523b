import json
import os
import subprocess
import sys

import psutil
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from workbench.cluster import registry
from workbench.cluster.registry import ClusterRecord, Endpoint
from workbench.cluster.status import TaskRecord
from workbench.server.models import ClusterInfo


def _mine(name: str, **extra) -> ClusterRecord:
    me = psutil.Process()
    return ClusterRecord(name=name, state="running", engines="local", owned=True, client_pid=me.pid,
                         client_created=me.create_time(), **extra)


def test_records_round_trip_and_stale_ones_are_pruned(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_REGISTRY_DIR", str(tmp_path))
    task = TaskRecord("worker", 0, 3, "host", "127.0.0.1:5", 42, ["/job:worker/replica:0/task:0/device:CPU:0"], [], "running")
    alive = _mine("alive", spec={"worker": ["127.0.0.1:5"]}, tasks=[task],
                  endpoints={"control": Endpoint("http://127.0.0.1:9", "secret")}, updated=2.0,
                  network="user-space links (pid 7): all: 1 Gbit/s")
    registry.write_record(alive)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    registry.write_record(ClusterRecord(name="stale", state="running", engines="local", owned=True,
                                        client_pid=dead.pid, client_created=1.0))
    assert registry.list_clusters() == [alive]  # read back into the same dataclass, tasks and endpoints included
    assert registry.read_record("alive") == alive and registry.read_record("stale") is None
    assert not (tmp_path / "stale.json").exists()
    assert (tmp_path / "alive.json").stat().st_mode & 0o077 == 0  # it holds a token: this user only
    assert "secret" in (tmp_path / "alive.json").read_text() and "secret" not in repr(registry.list_clusters())  # a cell shows no token
    # in a cell or a terminal: one table, a line per cluster (the CLI prints the same)
    shown = repr(registry.list_clusters()).splitlines()
    assert shown[0].split() == ["cluster", "state", "tasks", "engines", "job", "owner", "pid"]
    assert shown[2].split() == ["alive", "running", "worker:0@127.0.0.1:5", "local", "-", str(os.getpid())]
    assert "<td style='text-align:left'>worker:0@127.0.0.1:5</td>" in registry.list_clusters()._repr_html_()
    assert repr(alive) == f"<ClusterRecord 'alive' running: worker:0@127.0.0.1:5; engines='local', owner pid {os.getpid()}>"
    registry.remove_record("alive")
    assert registry.list_clusters() == [] and repr(registry.list_clusters()) == "no running workbench clusters"


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


def test_the_registry_is_this_users_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_REGISTRY_DIR", str(tmp_path / "clusters"))
    path = registry.write_record(_mine("mine"))
    assert (tmp_path / "clusters").stat().st_mode & 0o777 == 0o700
    assert path.stat().st_mode & 0o777 == 0o600
    (tmp_path / "clusters").chmod(0o755)  # loosened by someone: tightened again on the next write
    registry.write_record(_mine("mine"))
    assert (tmp_path / "clusters").stat().st_mode & 0o777 == 0o700


def test_a_record_others_could_write_is_neither_read_nor_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_REGISTRY_DIR", str(tmp_path))
    writable = registry.write_record(_mine("writable"))
    writable.chmod(0o666)
    elsewhere = registry.write_record(_mine("elsewhere"))
    elsewhere.rename(tmp_path / "impostor.json")  # a record that speaks for another cluster than its file's
    registry.write_record(_mine("fine"))
    assert [r.name for r in registry.list_clusters()] == ["fine"]
    assert writable.exists() and (tmp_path / "impostor.json").exists()  # not ours to delete


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_record_another_user_owns_is_not_read(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_REGISTRY_DIR", str(tmp_path))
    foreign = registry.write_record(_mine("foreign"))
    os.chown(foreign, 65534, 65534)  # nobody
    assert registry.list_clusters() == [] and foreign.exists()


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
                           max_leaves=20)
record_like = st.fixed_dictionaries({"name": st.just("fuzz")}, optional={
    key: json_values for key in ("state", "engines", "owned", "client_pid", "client_created", "tasks", "spec", "endpoints",
                                 "control", "registry_version", "updated", "gpus_per_worker")})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.one_of(st.binary(max_size=200), json_values.map(json.dumps).map(str.encode),
                         record_like.map(json.dumps).map(str.encode)))
@example(content=b"[" * 100_000 + b"]" * 100_000)  # nested deeper than the parser can go
@example(content=b'{"name": "fuzz", "client_pid": 1, "client_created": "yesterday"}')
@example(content=b'{"name": "fuzz", "tasks": "ps:0"}')
def test_a_corrupt_partial_or_hostile_file_is_skipped_and_the_running_cluster_kept(tmp_path, monkeypatch, content):
    monkeypatch.setenv("WORKBENCH_REGISTRY_DIR", str(tmp_path))
    running = _mine("running", spec={"worker": ["127.0.0.1:5"]})
    registry.write_record(running)
    fuzz = tmp_path / "fuzz.json"
    fuzz.write_bytes(content)
    fuzz.chmod(0o600)
    names = [r.name for r in registry.list_clusters()]  # never raises
    assert "running" in names and registry.read_record("running") == running
    assert (tmp_path / "running.json").exists()
    for record in registry.list_clusters():
        ClusterInfo.from_record(record)  # what the panel is sent can be built from whatever was read
