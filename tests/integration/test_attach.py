"""wb.attach: a second process uses a cluster that another one owns (what the panel's connection code runs)."""

import subprocess
import sys
import textwrap
import time

import pytest
from conftest import read_line
from training_helpers import attached_trainer, close_and_wait, train

import workbench as wb
from workbench.cluster import registry

pytestmark = pytest.mark.cluster

OWNER = textwrap.dedent("""
    import sys, workbench as wb
    cluster = wb.Cluster(ps=1, workers=2, name="wb-test-owner", progress=False).start()
    print("ready", flush=True)
    sys.stdin.read()  # until the test closes our stdin
    cluster.stop()
""")


@pytest.fixture(scope="module")
def owner():
    process = subprocess.Popen([sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert read_line(process, 240, "ready, once its cluster started").strip() == "ready"
        yield process
    finally:
        close_and_wait(process, 90)


def test_an_attached_cluster_trains_on_the_owners_tasks_and_detaches(owner):
    owners = registry.read_record("wb-test-owner")
    cluster = wb.attach("wb-test-owner")
    try:
        assert cluster.attached and cluster.state == "running"
        assert [t.name for t in cluster.tasks] == ["ps:0", "worker:0", "worker:1"]
        assert cluster.spec_dict == owners.spec
        job = train(cluster, strategy=wb.AsyncPS(steps_per_call=5), steps=30).wait(300)
        assert job.state == "finished" and len(job.history) == 30
        with pytest.raises(wb.ClusterStateError, match="is attached: process .* owns it"):
            cluster.scale(workers=3)
    finally:
        cluster.stop()
    assert cluster.state == "stopped"
    time.sleep(0.5)
    record = registry.read_record("wb-test-owner")
    assert record.client_pid == owner.pid and len(record.tasks) == 3  # the owner's cluster runs on


def test_attaching_to_an_unknown_cluster_says_what_runs():
    with pytest.raises(wb.ClusterStateError, match="no running cluster named 'nosuch'.*Workbench panel"):
        wb.attach("nosuch")


def test_the_attach_magic_makes_the_owners_cluster_this_kernels_default(owner):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.extension_manager.load_extension("workbench")
    status = shell.run_line_magic("wb", "attach wb-test-owner")
    try:
        assert "wb-test-owner" in str(status) and "worker:1" in str(status)
        assert wb.running_clusters()[-1].name == "wb-test-owner"
    finally:
        shell.run_line_magic("wb", "stop --name wb-test-owner")  # detaches this kernel only
    assert registry.read_record("wb-test-owner") is not None


def _owners_summary(name: str) -> dict | None:
    """What the owner's control endpoint (the panel's source) says of the cluster's newest job."""
    return registry.read_record(name).endpoints["control"].request("GET", "summary")


def test_a_job_of_an_attached_kernel_shows_in_the_owners_summary_while_it_trains(owner):
    import os

    cluster = wb.attach("wb-test-owner")
    try:
        job = train(cluster, strategy=wb.AsyncPS(steps_per_call=5), steps=3000)
        shown = f"{job.name} (pid {os.getpid()})"  # job names are per process: the sender's pid tells them apart
        seen, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline and len(seen) < 3:
            summary = _owners_summary("wb-test-owner")
            if summary and summary["job"] == shown and summary["state"] == "running" and summary["examples_per_s"] > 0:
                # the workers with steps in the summary's recent window: both, once the second's first step is in
                assert set(summary["workers"]) <= {"worker:0", "worker:1"}, summary
                if len(summary["workers"]) == 2:
                    seen.append((summary["steps_done"], summary["examples_per_s"]))
            time.sleep(1.0)
        assert len(seen) == 3, f"the owner's summary never showed {shown} training on both workers: {summary}"
        assert seen[0][0] < seen[-1][0], seen
        job.stop()
    finally:
        cluster.stop()
    final = _owners_summary("wb-test-owner")
    assert final["job"] == shown and final["state"] == "cancelled", final  # the last progress reached it too


def test_every_running_job_of_every_kernel_is_listed_in_the_owners_summary(owner):
    import os

    other = subprocess.Popen([sys.executable, "-c", attached_trainer("wb-test-owner")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    cluster = wb.attach("wb-test-owner")
    try:
        theirs = read_line(other, 180, "its job's name").strip()
        assert theirs.endswith(f"(pid {other.pid})"), theirs
        job = train(cluster, strategy=wb.AsyncPS(steps_per_call=5), steps=100000)
        ours = f"{job.name} (pid {os.getpid()})"
        deadline, summary = time.monotonic() + 120, None
        while time.monotonic() < deadline:
            summary = _owners_summary("wb-test-owner")
            listed = [summary["job"], *summary.get("running", [])] if summary else []
            if any(ours in line for line in listed) and any(theirs in line for line in listed):
                break
            time.sleep(1.0)
        assert summary["job"] in (ours, theirs) and len(summary["running"]) == 1, summary
        assert (theirs if summary["job"] == ours else ours) in summary["running"][0], summary
        job.stop()
    finally:
        cluster.stop()
        close_and_wait(other, 120)
