"""One run per job in MLflow (a real tracking server on loopback) and W&B (offline run files), from one callback.

What the trackers' own Keras callbacks log, per strategy, is checked beside Keras's other callbacks in
``test_keras_fit.py``; here, what only a distributed job has: a worker killed and re-hosted, a scale, the
parameters, series, events and artifacts of each run, two jobs giving two runs, and a job resumed from a
checkpoint continuing its run.
"""

import json
import os
import signal
from pathlib import Path

import keras
import pytest
import wandb
from mlflow import MlflowClient
from trackers import wandb_run
from training_helpers import LOSS, make_model, signal_process, wait_for

import workbench as wb

pytestmark = pytest.mark.cluster

PER_EPOCH, EPOCHS = 100, 4
WAIT = 120  # seconds: every wait here is bounded


def _train(cluster, callbacks, checkpoint, epochs=EPOCHS, steps_per_epoch=PER_EPOCH):
    return wb.train(cluster, make_model, wb.datasets.digits, LOSS, keras.optimizers.Adam(0.01), metrics=["accuracy"],
                    strategy=wb.SyncPS(steps_per_call=5), epochs=epochs, steps_per_epoch=steps_per_epoch,
                    batch_size=60, seed=3, validation_data=wb.datasets.digits_test, checkpoint=checkpoint,
                    callbacks=callbacks)


def test_a_job_with_a_fault_and_a_scale_is_one_run_with_its_events_series_and_artifacts(mlflow_experiment, tmp_path,
                                                                                      no_leftover_processes):
    quiet = wandb.Settings(silent=True)
    tracked = [wb.tracking.MLflow(), wb.tracking.WandB(project="tracking", mode="offline", dir=tmp_path, settings=quiet)]
    checkpoint = wb.Checkpoint(tmp_path / "ckpt", every=100)
    with wb.Cluster(ps=1, workers=2, name=f"wb-test-tracking-{os.getpid()}", progress=False) as cluster:
        job = _train(cluster, tracked, checkpoint)
        wait_for(lambda: job.steps_done >= 40 or job.state != "running", WAIT, "40 steps")
        cluster.scale(workers=3)  # returns once the new engine serves; the job follows at its next step boundary
        wait_for(lambda: job.events or job.state != "running", WAIT, "the job to follow the scale")
        followed = job.events[0]["step"] if job.events else 0
        # the kill comes steps after the scale, however long the new engine took to start
        wait_for(lambda: job.steps_done >= max(200, followed + 20) or job.state != "running", WAIT, "200 steps")
        signal_process(cluster.task("worker:1").pid, signal.SIGKILL)
        job.wait(300)
        assert job.state == "finished", job.error
        second = wb.train(cluster, make_model, wb.datasets.digits, LOSS, steps=20, batch_size=60,
                          callbacks=[wb.tracking.MLflow()]).wait(WAIT)
        # the first job's checkpoints, two more epochs: its run goes on
        resumed_tracker = wb.tracking.MLflow()
        resumed = _train(cluster, [resumed_tracker], wb.Checkpoint(tmp_path / "ckpt", resume=True), epochs=EPOCHS + 1)
        resumed.wait(300)
    wandb.teardown()  # W&B's service process, which otherwise lives as long as this one

    client, run_id = MlflowClient(), tracked[0].run_id
    runs = client.search_runs([mlflow_experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == sorted([job.name, second.name])  # two jobs, two runs
    assert resumed_tracker.run_id == run_id and resumed.start_step == EPOCHS * PER_EPOCH
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["strategy.name"] == "sync-ps" and params["strategy.backup_workers"] == "0"
    assert params["cluster.ps"] == "1" and params["cluster.workers"] == "2" and params["global_batch_size"] == "60"
    assert params["cluster.hosts.worker:0"].startswith("127.0.0.1:") and params["seed"] == "3"
    assert params["versions.tensorflow"] and params["versions.workbench"] == wb.__version__
    assert float(params["optimizer.learning_rate"]) == pytest.approx(0.01)
    assert params["checkpoint.directory"] == str(tmp_path / "ckpt")

    # epoch metrics: the first job's epochs, then the resumed job's last one, at their epoch numbers
    losses = client.get_metric_history(run_id, "val_loss")
    expected = [*job.keras_history.history["val_loss"], *resumed.keras_history.history["val_loss"]]
    assert [m.step for m in losses] == list(range(EPOCHS + 1))
    assert [m.value for m in losses] == pytest.approx(expected, rel=1e-9)
    # per worker, at most a point a second and one per epoch, at the global step; the scaled-in worker too
    rates = client.get_metric_history(run_id, "examples_per_second/worker-2")
    assert rates and all(m.value > 0 for m in rates) and min(m.step for m in rates) > 40
    assert len(client.get_metric_history(run_id, "dropped_gradients/worker-0")) == EPOCHS + 1

    # the events, with their steps: the scale, then the killed worker re-hosted
    events = [v for k, v in sorted(run.data.tags.items()) if k.startswith("workbench.event.")]
    scale = next(e for e in events if "scales: scale to 3 worker(s) (joined: worker:2)" in e)
    lost = next(e for e in events if "worker:1 faults: lost: re-hosted" in e)
    assert 40 <= int(scale.split(":")[0].removeprefix("step ")) < int(lost.split(":")[0].removeprefix("step "))

    # artifacts: summary, events, timeline, the trained model, the checkpoints
    stored = {a.path for a in client.list_artifacts(run_id)} | {a.path for a in client.list_artifacts(run_id, "model")}
    assert {"model_summary.txt", "events.json", "timeline.json", f"model/{resumed.name}.keras", "checkpoints"} <= stored
    local = Path(client.download_artifacts(run_id, "timeline.json", str(tmp_path)))
    assert json.loads(local.read_text())["traceEvents"]

    # the same in W&B's offline run
    offline = wandb_run(Path(tracked[1].run.dir).parent)
    assert offline["config"]["strategy.name"] == "sync-ps" and offline["config"]["cluster.workers"] == 2
    epochs = [row["epoch/val_loss"] for row in offline["history"] if "epoch/val_loss" in row]
    assert epochs == pytest.approx(job.keras_history.history["val_loss"], rel=1e-9)
    assert any(row.get("examples_per_second/worker-2", 0) > 0 for row in offline["history"])
    assert {"events.json", "timeline.json", f"model/{job.name}.keras", "model_summary.txt"} <= set(offline["files"])
    assert any(f.startswith("checkpoints/") for f in offline["files"])
    table = [row for row in offline["history"] if "events/path" in row]
    assert table, "no events table logged"


class _TrackerGoneAfterOneSend(wb.tracking.MLflow):
    """MLflow's tracker, whose store stops answering after one send (a tracking server that went away)."""

    sends = 0

    def _metrics(self, rows):
        self.sends += 1
        if self.sends > 1:
            raise ConnectionError("the tracking server went away")
        super()._metrics(rows)


def test_a_tracker_that_fails_mid_job_is_said_once_and_the_job_goes_on(cluster, mlflow_experiment):
    tracker = _TrackerGoneAfterOneSend()
    with pytest.warns(wb.TrackingWarning, match=r"_TrackerGoneAfterOneSend could not log metrics: ConnectionError: "
                                                 r"the tracking server went away\. The job goes on"):
        job = wb.train(cluster, make_model, wb.datasets.digits, LOSS, epochs=20, steps_per_epoch=100, batch_size=64,
                       callbacks=[tracker]).wait(WAIT)
    assert job.state == "finished" and job.steps_done == 2000
    assert tracker.sends == 2  # none after the failure
    assert MlflowClient().get_run(tracker.run_id).info.status == "FAILED"  # it still answered the run's end
