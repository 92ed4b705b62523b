"""Elastic training: ``cluster.scale(workers=N)`` while a job trains; the job follows at its next step boundary."""

import warnings

import pytest
from training_helpers import train, wait_for

import workbench as wb

pytestmark = pytest.mark.cluster

STEPS_SHORT = 60
STEPS = 1500  # long enough that both scales land mid-job on a slow machine (2-3 ms a step per worker here)


def _scale_twice(cluster, job, up: int, down: int) -> None:
    """Scale up once the job has trained a while, then down once the new workers took part."""
    wait_for(lambda: job.steps_done >= 100 or job.state != "running", 120, "the job's first 100 steps")
    assert job.state == "running", job.error
    cluster.scale(workers=up)
    joined = {f"worker:{i}" for i in range(1, up)}
    wait_for(lambda: joined <= {w for r in job.history for w in r["worker"].split(",")} or job.state != "running",
             120, f"steps from {sorted(joined)}")
    assert job.state == "running", f"the job ended before the scale-down could land mid-job: {job.describe()}"
    cluster.scale(workers=down)


@pytest.mark.parametrize("strategy", [wb.AsyncPS, wb.SyncPS], ids=["async-ps", "sync-ps"])
def test_scale_up_and_down_while_a_job_trains(strategy, capsys, no_leftover_processes):
    with wb.Cluster(ps=1, workers=1, name=f"wb-test-elastic-{strategy.name}", progress=False) as cluster:
        job = train(cluster, strategy=strategy(steps_per_call=5), steps=STEPS)
        board = wb.dashboard(cluster, plots=("timeline", "throughput"))  # opened on one worker
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            _scale_twice(cluster, job, up=3, down=2)
            job.wait(600)
        assert job.state == "finished", job.error
        history = job.history
        assert [r["step"] for r in history] == list(range(STEPS))  # every step once: none lost, none run twice
        workers = [set(r["worker"].split(",")) for r in history]
        assert workers[0] == {"worker:0"}
        assert {w for ws in workers for w in ws} == {"worker:0", "worker:1", "worker:2"}
        # after the scale-down worker:2 computes nothing more: its steps all come before the last change
        events = job.events
        assert [e["kind"] for e in events] == ["scale", "scale"], events
        up, down = events
        assert up["joined"] == ["worker:1", "worker:2"] and up["left"] == [] and up["workers"] == ["worker:0", "worker:1", "worker:2"]
        assert down["left"] == ["worker:2"] and down["workers"] == ["worker:0", "worker:1"]
        assert 0 < up["step"] < down["step"] < STEPS
        assert all(e["pause_seconds"] >= 0 and e["drain_seconds"] >= 0 for e in events)
        assert all(r["step"] < down["step"] for r, ws in zip(history, workers) if "worker:2" in ws)
        assert all("worker:1" not in ws for ws in workers[:up["step"]])
        if strategy is wb.SyncPS:  # no backup workers: each step waits for every worker, one, then three, then two
            assert {r["aggregated"] for r in history[:up["step"]]} == {1}
            assert {r["aggregated"] for r in history[up["step"]:down["step"]]} == {3}
            assert {r["aggregated"] for r in history[down["step"]:]} == {2}
        # per-worker batch kept (elastic_batch="per-worker"): the global batch follows the workers
        assert job.info["per_worker_batch_size"] == 64 and job.info["global_batch_size"] == 128
        assert job.info["workers"] == ["worker:0", "worker:1"]
        told = capsys.readouterr().out
        assert f"job {job.name}: 3 worker(s) from step {up['step']} (joined: worker:1, worker:2; paused" in told, told
        assert f"job {job.name}: 2 worker(s) from step {down['step']} (left: worker:2; paused" in told, told
        assert not [w for w in said if "worker(s) from step" in str(w.message)]  # information, not a warning
        board.update()  # the new workers' rows appear in the timeline opened before they existed
        rows = board.components["timeline"].rows
        assert all(any(f"task:{i}" in row and "job:worker" in row for row in rows) for i in range(3)), rows
        board.close()
        assert job.evaluate(wb.datasets.digits_test)["accuracy"] >= 0.90
        assert [r.state for r in cluster.tasks] == ["running"] * 3
        assert [r.name for r in cluster.tasks] == ["ps:0", "worker:0", "worker:1"]


def test_global_batch_is_kept_when_asked(no_leftover_processes):
    with wb.Cluster(ps=1, workers=1, name="wb-test-elastic-global", progress=False) as cluster:
        job = train(cluster, strategy=wb.AsyncPS(elastic_batch="global", steps_per_call=5), steps=STEPS, batch_size=64)
        wait_for(lambda: job.steps_done >= 50 or job.state != "running", 120, "the first steps")
        with pytest.raises(wb.ConfigurationError, match="does not split evenly over 3 workers"):
            cluster.scale(workers=3)  # refused before any engine starts
        assert len(cluster.tasks) == 2
        cluster.scale(workers=2)
        job.wait(600)
        assert job.state == "finished", job.error
        assert job.info["per_worker_batch_size"] == 32 and job.info["global_batch_size"] == 64
        assert [r["step"] for r in job.history] == list(range(STEPS))
        assert job.events[0]["joined"] == ["worker:1"]


def test_allreduce_refuses_a_scale_while_it_trains(no_leftover_processes):
    with wb.Cluster(ps=0, workers=2, name="wb-test-elastic-allreduce", progress=False) as cluster:
        job = train(cluster, strategy="allreduce", steps=600)
        wait_for(lambda: job.steps_done >= 20 or job.state != "running", 180, "the first steps")
        for workers in (3, 1):
            with pytest.raises(wb.ClusterStateError, match="all-reduce group .* cannot take or lose members mid-job"):
                cluster.scale(workers=workers)
        assert len(cluster.tasks) == 2  # nothing started or stopped
        job.wait(600)
        assert job.state == "finished" and [r["step"] for r in job.history] == list(range(600))
        cluster.scale(workers=3)  # between jobs it scales as always
        assert len(cluster.tasks) == 3


def test_sync_ps_refuses_to_scale_below_its_backup_workers(no_leftover_processes):
    with wb.Cluster(ps=1, workers=2, name="wb-test-elastic-backup", progress=False) as cluster:
        job = train(cluster, strategy=wb.SyncPS(backup_workers=1, steps_per_call=5), steps=STEPS)
        wait_for(lambda: job.steps_done >= 20 or job.state != "running", 120, "the first steps")
        with pytest.raises(wb.ConfigurationError, match="backup_workers=1"):
            cluster.scale(workers=1)
        job.stop()
        assert job.state == "cancelled" and len(cluster.tasks) == 3


def test_a_connected_kernel_keeps_its_variables_across_a_scale(no_leftover_processes):
    import tensorflow as tf

    with wb.Cluster(ps=1, workers=1, name="wb-test-elastic-connection", progress=False) as cluster:
        with cluster.device("ps:0"):
            variable = tf.Variable([1.0, 2.0])
        cluster.scale(workers=2)  # no job: the kernel's connection grows in place
        with cluster.device("worker:1"):
            assert (variable * 2).numpy().tolist() == [2.0, 4.0]
        cluster.scale(workers=1)
        with cluster.device("worker:0"):
            assert (variable + 1).numpy().tolist() == [2.0, 3.0]


def test_a_scale_in_the_jobs_last_steps_is_in_its_events(capsys, no_leftover_processes):
    import threading

    import keras

    release = threading.Event()

    class HoldTheLastBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == STEPS_SHORT - 1:
                release.wait(120)  # the scale below lands while the job has no step left to run

    with wb.Cluster(ps=1, workers=1, name="wb-test-elastic-last", progress=False) as cluster:
        job = train(cluster, steps=STEPS_SHORT, callbacks=[HoldTheLastBatch()])
        wait_for(lambda: job.steps_done == STEPS_SHORT or job.state != "running", 120, "the job's last step")
        cluster.scale(workers=2)
        release.set()
        job.wait(120)
        assert job.state == "finished", job.error
        (event,) = job.events
        assert event["kind"] == "scale" and event["step"] == STEPS_SHORT and event["joined"] == ["worker:1"], event
        assert f"job {job.name}: 2 worker(s) after its last step (joined: worker:1)" in capsys.readouterr().out


@pytest.mark.parametrize(("strategy", "workers", "change"), [(wb.AsyncPS, 2, {"left": ["worker:2"]}),
                                                         (wb.SyncPS, 4, {"joined": ["worker:3"]})],
                         ids=["async-ps-down", "sync-ps-up"])
def test_a_scale_right_after_a_worker_is_killed_goes_on_while_it_is_rehosted(strategy, workers, change, no_leftover_processes):
    import os
    import signal
    import time

    with wb.Cluster(ps=1, workers=3, name=f"wb-test-elastic-kill-{strategy.name}", progress=False) as cluster:
        job = train(cluster, strategy=strategy(steps_per_call=5), steps=STEPS, batch_size=96)
        wait_for(lambda: job.steps_done >= 100 or job.state != "running", 120, "the job's first 100 steps")
        os.kill(cluster.task("worker:1").pid, signal.SIGKILL)
        started = time.monotonic()
        cluster.scale(workers=workers)  # before the loss is noticed: the scale and the re-hosting each wait for the other
        # measured 0.3 s; the scale once held the cluster until its start timeout (300 s) while the re-hosting waited
        assert time.monotonic() - started < 60
        job.wait(600)
        assert job.state == "finished", job.error
        assert [r["step"] for r in job.history] == list(range(STEPS))
        (scale,) = [e for e in job.events if e["kind"] == "scale"]
        assert scale["workers"] == [f"worker:{i}" for i in range(workers)], scale
        assert all(scale[what] == names for what, names in change.items()), scale
        for name in change.get("joined", []):  # it trains: this kernel's connection reached it although a task was down
            assert any(name in r["worker"] for r in job.history if r["step"] > scale["step"])
        rehosted = cluster.task("worker:1")
        assert rehosted.state == "running" and rehosted.restarts == 1  # once: not again by the run after the scale
        (fault,) = [f for f in job.faults if f["task"] == "worker:1"]
        assert fault["action"] == "re-hosted" and fault["recovered"] is not None, fault
        assert any("worker:1" in r["worker"] for r in job.history if r["step"] > scale["step"])  # it trains again
