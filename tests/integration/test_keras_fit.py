"""wb.train as a Keras user drives model.fit: epochs, validation, real Keras callbacks, TensorBoard, per strategy."""

import csv
from pathlib import Path

import keras
import numpy as np
import pytest
from IPython.core.interactiveshell import InteractiveShell
from training_helpers import LOSS, make_model

import workbench as wb

pytestmark = pytest.mark.cluster

STRATEGIES = ["async-ps", "sync-ps", "allreduce"]
PER_EPOCH = 20  # two calls of steps_per_call=10 per epoch


class Recorder(keras.callbacks.Callback):
    """Every hook, in order, with what it was given; the weights and learning rate at each epoch's end."""

    def __init__(self):
        super().__init__()
        self.calls, self.weights, self.rates = [], {}, {}

    def on_train_begin(self, logs=None):
        self.calls.append(("train_begin",))

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(("epoch_begin", epoch))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("batch_end", batch, dict(logs)))

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(("epoch_end", epoch, dict(logs)))
        self.weights[epoch] = self.model.get_weights()
        self.rates[epoch] = float(keras.ops.convert_to_tensor(self.model.optimizer.learning_rate))

    def on_train_end(self, logs=None):
        self.calls.append(("train_end",))


def fit(cluster, strategy, **kwargs):
    options = dict(loss=LOSS, optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"], strategy=strategy,
                   batch_size=64, seed=7, steps_per_epoch=PER_EPOCH)
    options.update(kwargs)
    return wb.train(cluster, make_model, wb.datasets.digits, **options)


def tensorboard_runs(log_dir) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Every run's scalars, read back with TensorBoard's own reader: ``{run: {tag: [(step, value), ...]}}``."""
    from tensorboard.backend.event_processing import event_multiplexer
    from tensorboard.util import tensor_util

    reader = event_multiplexer.EventMultiplexer()
    reader.AddRunsFromDirectory(str(log_dir))
    reader.Reload()
    runs = {}
    for run, tags in reader.Runs().items():
        runs[run] = {tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in reader.Tensors(run, tag)]
                     for tag in tags["tensors"] if tag not in ("keras", "workbench/faults")}
    return runs


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_epochs_validation_and_keras_callbacks_as_in_model_fit(cluster, strategy, tmp_path, mlflow_experiment):
    import mlflow
    import wandb
    from wandb.integration.keras import WandbMetricsLogger

    recorder = Recorder()
    users_wandb = wandb.init(mode="offline", dir=tmp_path, project="keras-fit", settings=wandb.Settings(silent=True))
    trackers = [mlflow.keras.MlflowCallback(), WandbMetricsLogger(),  # the trackers' own, as under model.fit
                wb.tracking.MLflow(), wb.tracking.WandB(mode="offline", dir=tmp_path, settings=wandb.Settings(silent=True))]
    callbacks = [recorder, keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
                 keras.callbacks.ModelCheckpoint(str(tmp_path / "model.keras")),
                 keras.callbacks.TensorBoard(str(tmp_path / "tb")), *trackers]
    try:
        with mlflow.start_run() as users_run:
            job = fit(cluster, strategy, epochs=3, validation_data=wb.datasets.digits_test, callbacks=callbacks).wait(300)
    finally:
        users_wandb.finish()
    assert job.state == "finished" and not job.stopped_early and job.steps_done == 3 * PER_EPOCH
    _assert_tracked(job, users_run.info.run_id, mlflow_experiment, trackers, Path(users_wandb.dir).parent)

    # the hooks, in model.fit's order; one batch hook per remote call, with that call's newest step
    kinds = [c[0] for c in recorder.calls]
    assert kinds[:2] == ["train_begin", "epoch_begin"] and kinds[-1] == "train_end"
    for epoch in range(3):
        begin = recorder.calls.index(("epoch_begin", epoch))
        end = kinds.index("epoch_end", begin)
        # steps_per_call=10: batches 0-9, 10-19 (async-ps: in the order the workers' calls come back)
        assert sorted(c[1] for c in recorder.calls[begin + 1:end]) == [9, 19]
    history = job.history
    assert {type(v) for r in history for v in r.values()} <= {int, float, str}
    for epoch in range(3):
        _, _, logs = next(c for c in recorder.calls if c[0] == "epoch_end" and c[1] == epoch)
        steps = [r for r in history if epoch * PER_EPOCH <= r["step"] < (epoch + 1) * PER_EPOCH]
        assert logs["loss"] == pytest.approx(np.mean([r["loss"] for r in steps]), rel=1e-9)
        assert logs["accuracy"] == pytest.approx(np.mean([r["accuracy"] for r in steps]), rel=1e-9)
        assert set(logs) == {"loss", "accuracy", "val_loss", "val_accuracy"}
        assert all(type(v) is float for v in logs.values())

    # validation ran on the trained variables: the last epoch's equals evaluating the job once it ended
    final = job.evaluate(wb.datasets.digits_test)
    assert job.keras_history.history["val_loss"][-1] == pytest.approx(final["loss"], rel=1e-5)
    assert job.keras_history.history["val_accuracy"][-1] == pytest.approx(final["accuracy"], abs=1e-6)
    assert job.keras_history.epoch == [0, 1, 2] and len(job.keras_history.history["loss"]) == 3
    assert job.keras_history.history["loss"][-1] < job.keras_history.history["loss"][0]

    # CSVLogger: one row per epoch, the values the callbacks saw
    with open(tmp_path / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    assert [float(r["val_loss"]) for r in rows] == pytest.approx(job.keras_history.history["val_loss"], rel=1e-9)

    # ModelCheckpoint: a model that loads compiled, and scores as job.evaluate does
    loaded = keras.models.load_model(tmp_path / "model.keras")
    x, y = wb.datasets.digits_arrays("test")
    scored = loaded.evaluate(x, y, verbose=0, return_dict=True)
    assert scored["loss"] == pytest.approx(final["loss"], rel=1e-4)
    assert scored["accuracy"] == pytest.approx(final["accuracy"], abs=1e-6)

    # TensorBoard: Keras's runs, and one run per worker with what only a distributed job has
    runs = tensorboard_runs(tmp_path / "tb")
    assert {"train", "validation", "worker-0", "worker-1"} <= set(runs)
    assert [v for _, v in runs["train"]["epoch_loss"]] == pytest.approx(job.keras_history.history["loss"], rel=1e-6)
    assert [v for _, v in runs["validation"]["epoch_loss"]] == pytest.approx(job.keras_history.history["val_loss"], rel=1e-6)
    for worker in ("worker-0", "worker-1"):
        tags = runs[worker]
        assert tags["workbench/examples_per_second"] and all(v > 0 for _, v in tags["workbench/examples_per_second"])
        assert all(v > 0 for _, v in tags["workbench/step_time_seconds"])
        if strategy == "async-ps":
            assert len(tags["workbench/staleness"]) == 3 and all(v >= 0 for _, v in tags["workbench/staleness"])
        if strategy == "sync-ps":
            assert [v for _, v in tags["workbench/dropped_gradients"]] == [0, 0, 0]  # no backup workers: none dropped
        if strategy != "allreduce":
            assert {v for _, v in tags["workbench/bytes_per_step"]} == {job.info["bytes_per_step"]["total"]}
    steps = [s for s, _ in runs["worker-0"]["workbench/step_time_seconds"]]
    assert steps == sorted(steps) and 0 < steps[-1] <= 3 * PER_EPOCH  # the x axis is the job's global step


def _assert_tracked(job, users_run: str, experiment, trackers: list, users_wandb: Path) -> None:
    """The trackers' own callbacks logged the epochs into the user's runs, as under model.fit; wb.tracking's logged
    the job's own run beside them; and nothing else: no run started in the job's thread."""
    from mlflow import MlflowClient
    from trackers import wandb_run

    history, client = job.keras_history.history, MlflowClient()
    runs = {r.info.run_id: r for r in client.search_runs([experiment.experiment_id])}
    ours = trackers[2].run_id
    assert set(runs) == {users_run, ours}, [r.info.run_name for r in runs.values()]
    assert runs[ours].data.tags["mlflow.parentRunId"] == users_run and runs[ours].info.status == "FINISHED"
    for run in (users_run, ours):
        for name, values in history.items():
            assert [m.value for m in client.get_metric_history(run, name)] == pytest.approx(values, rel=1e-9), (run, name)
    assert "optimizer_learning_rate" in runs[users_run].data.params  # MlflowCallback's on_train_begin
    assert runs[ours].data.params["strategy.name"] == job.options.strategy.name
    assert client.get_metric_history(ours, "examples_per_second/worker-1")
    assert wandb_run(users_wandb)["history"][-1]["epoch/val_loss"] == pytest.approx(history["val_loss"][-1], rel=1e-9)
    own = wandb_run(Path(trackers[3].run.dir).parent)
    assert [row["epoch/loss"] for row in own["history"] if "epoch/loss" in row] == pytest.approx(history["loss"], rel=1e-9)
    assert own["config"]["strategy.name"] == job.options.strategy.name


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_early_stopping_ends_the_job_early_and_cleanly_with_the_best_weights(cluster, strategy):
    recorder = Recorder()
    # no epoch improves the loss by 10: stop after epoch 1, put epoch 0's weights back
    stopper = keras.callbacks.EarlyStopping(monitor="loss", min_delta=10, patience=1, restore_best_weights=True)
    job = fit(cluster, strategy, epochs=6, callbacks=[stopper, recorder]).wait(300)
    assert job.state == "finished" and job.stopped_early and job.steps_done == 2 * PER_EPOCH
    assert stopper.stopped_epoch == 1 and job.keras_history.epoch == [0, 1] and job.epoch == 1
    assert [c[0] for c in recorder.calls][-1] == "train_end"
    assert not all(np.array_equal(a, b) for a, b in zip(recorder.weights[0], recorder.weights[1]))
    # the best weights were restored where the job keeps its variables: job.model holds them
    assert all(np.array_equal(a, b) for a, b in zip(job.model.get_weights(), recorder.weights[0]))
    assert cluster.job_queue.current is None
    assert fit(cluster, strategy, epochs=1, steps_per_epoch=10).wait(120).state == "finished"  # the cluster is free


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_callbacks_that_monitor_a_metric_find_whether_it_should_rise_as_under_model_fit(cluster, strategy, tmp_path):
    # mode="auto": Keras looks the metric up among the model's compiled metrics, which model.fit has built by then
    stopper = keras.callbacks.EarlyStopping(monitor="val_accuracy", patience=1)
    best = keras.callbacks.ModelCheckpoint(str(tmp_path / "best.keras"), monitor="val_accuracy", save_best_only=True)
    job = fit(cluster, strategy, epochs=3, validation_data=wb.datasets.digits_test, callbacks=[stopper, best]).wait(300)
    assert job.state == "finished", job.error
    accuracies = job.keras_history.history["val_accuracy"]
    assert stopper.monitor_op is keras.ops.greater and best.best == max(accuracies) > 0.5
    assert (tmp_path / "best.keras").exists()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_learning_rate_schedule_changes_what_the_optimizer_applies_where_it_lives(cluster, strategy):
    recorder = Recorder()
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, rate: 0.01 if epoch == 0 else 0.0)
    job = fit(cluster, strategy, epochs=3, callbacks=[schedule, recorder]).wait(300)
    assert recorder.rates == {0: pytest.approx(0.01), 1: 0.0, 2: 0.0}
    assert job.keras_history.history["learning_rate"] == [pytest.approx(0.01), 0.0, 0.0]
    # with a rate of 0 from epoch 1 on, the optimizer (on the ps, or every all-reduce worker) changes nothing
    for epoch in (1, 2):
        assert all(np.array_equal(a, b) for a, b in zip(recorder.weights[0], recorder.weights[epoch]))
    if strategy != "allreduce":
        assert "/job:ps/" in job.trainer.optimizer._learning_rate.value.device
        assert float(job.trainer.optimizer.learning_rate.numpy()) == 0.0


def test_stop_training_in_a_batch_hook_ends_the_epoch_after_the_call_in_flight(cluster):
    class StopAfterFirstCall(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.model.stop_training = True

    recorder = Recorder()
    job = fit(cluster, "allreduce", epochs=3, steps_per_epoch=40, validation_data=wb.datasets.digits_test,
              callbacks=[StopAfterFirstCall(), recorder]).wait(300)
    # the epoch's second call went out before the first came back (the engines go on without waiting for this
    # kernel): it completes, and no third goes out
    assert job.stopped_early and job.steps_done == 20
    assert [c[:2] for c in recorder.calls if c[0] != "batch_end"] == [
        ("train_begin",), ("epoch_begin", 0), ("epoch_end", 0), ("train_end",)]
    assert "val_loss" in job.keras_history.history  # the cut-short epoch is still validated, as in Keras


def test_a_callback_that_raises_fails_the_job_naming_it_and_frees_the_cluster(cluster):
    class Broken(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raise RuntimeError("disk full")

    job = fit(cluster, "async-ps", epochs=2, callbacks=[Broken()])
    with pytest.raises(wb.WorkbenchError, match=r"callback Broken.on_epoch_end raised RuntimeError: disk full"):
        job.wait(300)
    assert job.state == "failed" and job.steps_done == PER_EPOCH
    assert cluster.job_queue.current is None


def test_validation_data_as_a_dataset_and_validation_steps(cluster):
    import tensorflow as tf

    x, y = wb.datasets.digits_arrays("test")
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    job = fit(cluster, "sync-ps", epochs=2, validation_data=dataset, validation_freq=2).wait(300)
    assert len(job.keras_history.history["val_loss"]) == 1  # validation_freq=2: after epoch 1 only
    assert job.keras_history.history["val_loss"][0] == pytest.approx(job.evaluate(dataset)["loss"], rel=1e-5)
    # validation_steps: the first batches only (3 of batch_size=64 examples), spread over the workers
    first = dataset.take(192)
    job = fit(cluster, "async-ps", epochs=1, validation_data=wb.datasets.digits_test, validation_steps=3).wait(300)
    assert job.keras_history.history["val_loss"][0] == pytest.approx(job.evaluate(first)["loss"], rel=1e-5)


def test_epochs_alone_take_one_pass_of_the_data_per_epoch(cluster):
    job = wb.train(cluster, make_model, wb.datasets.digits, loss=LOSS, epochs=2, batch_size=64, seed=7)
    # digits' training split has 1347 examples: 21 batches of 64 per epoch
    assert (job.options.steps_per_epoch, job.options.steps) == (21, 42)
    job.wait(300)
    assert job.keras_history.epoch == [0, 1]


def test_fit_arguments_that_cannot_work_get_errors_saying_what_to_pass(cluster):
    import tensorflow as tf

    with pytest.raises(wb.WorkbenchError, match="pass a list of keras.callbacks.Callback"):
        fit(cluster, "async-ps", callbacks=["EarlyStopping"])
    with pytest.raises(wb.WorkbenchError, match="validation_steps=3 needs validation_data"):
        fit(cluster, "async-ps", validation_steps=3)
    with pytest.raises(wb.WorkbenchError, match="contradicts epochs=2 x steps_per_epoch=20"):
        fit(cluster, "async-ps", epochs=2, steps=100)
    with pytest.raises(wb.WorkbenchError, match="pass steps_per_epoch="):
        wb.train(cluster, make_model, lambda ctx: wb.datasets.digits(ctx).repeat(), loss=LOSS, epochs=2)
    with pytest.raises(wb.WorkbenchError, match="validation_data repeats forever.*validation_steps"):
        x, y = wb.datasets.digits_arrays("test")
        fit(cluster, "async-ps", validation_data=tf.data.Dataset.from_tensor_slices((x, y)).repeat())
    with pytest.raises(wb.WorkbenchError, match="validation_data=ndarray"):
        fit(cluster, "async-ps", validation_data=x)
    with pytest.raises(wb.WorkbenchError, match="epochs=0 is not allowed"):
        fit(cluster, "async-ps", epochs=0)
    assert cluster.job_queue.current is None


def test_a_placed_model_trains_with_epochs_validation_and_callbacks(cluster, tmp_path):
    def two_layers():
        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu", name="hidden"),
                                 keras.layers.Dense(10, name="logits")])

    placed = wb.place(two_layers, {"hidden": "worker:0", "logits": "worker:1"}, cluster=cluster)
    job = placed.train(wb.datasets.digits, LOSS, keras.optimizers.Adam(0.01), metrics=["accuracy"], epochs=2,
                       steps_per_epoch=10, validation_data=wb.datasets.digits_test,
                       callbacks=[keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))]).wait(300)
    with open(tmp_path / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [0, 1] and float(rows[1]["val_loss"]) > 0
    assert float(rows[1]["val_loss"]) == pytest.approx(job.evaluate(wb.datasets.digits_test)["loss"], rel=1e-5)


def test_wb_train_magic_takes_epochs_validation_data_callbacks_and_a_tracker(cluster, tmp_path, mlflow_experiment):
    shell = InteractiveShell.instance()
    shell.extension_manager.load_extension("workbench")
    shell.user_ns.update(make_model=make_model, digits=wb.datasets.digits, digits_test=wb.datasets.digits_test,
                         cbs=[keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))])
    job = shell.run_line_magic("wb", f"train make_model digits --loss sparse_categorical_crossentropy --epochs 2 "
                                     f"--steps-per-epoch 10 --validation-data digits_test --callbacks cbs --wait "
                                     f"--tracking mlflow --name {cluster.name}")
    assert job.state == "finished" and job.keras_history.epoch == [0, 1]
    assert "val_loss" in job.keras_history.history
    assert (tmp_path / "log.csv").read_text().count("\n") == 3
    from IPython.core.error import UsageError
    from mlflow import MlflowClient

    (run,) = MlflowClient().search_runs([mlflow_experiment.experiment_id])  # --tracking mlflow: the job's run
    assert run.info.run_name == job.name and run.info.status == "FINISHED"
    assert [m.value for m in MlflowClient().get_metric_history(run.info.run_id, "val_loss")] == pytest.approx(
        job.keras_history.history["val_loss"], rel=1e-9)
    with pytest.raises(UsageError, match="--tracking neptune: unknown tracker 'neptune'"):
        shell.run_line_magic("wb", f"train make_model digits --loss mse --tracking neptune --name {cluster.name}")

    with pytest.raises(UsageError, match="the callbacks 'nosuch' is not defined.*nosuch = \\[keras.callbacks"):
        shell.run_line_magic("wb", f"train make_model digits --loss mse --callbacks nosuch --name {cluster.name}")
    with pytest.raises(UsageError, match="backup_workers does not apply to strategy 'async-ps': it is an option of 'sync-ps'"):
        shell.run_line_magic("wb", f"train make_model digits --loss mse --backup-workers 1 --name {cluster.name}")
    with pytest.raises(UsageError, match="needs a loss: pass loss= .* or compile the model"):
        shell.run_line_magic("wb", f"train make_model digits --name {cluster.name}")
    assert cluster.job_queue.current is None  # nothing was started


def compiled(optimizer):
    """A model function that returns a compiled model, as a Keras user writes one before ``fit`` (self-contained: an
    all-reduce job sends it to the engines by value, and they have no ``training_helpers`` to import)."""
    def make():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer=optimizer,
                      metrics=["accuracy"])
        return model

    return make


@pytest.mark.parametrize("strategy", ["async-ps", "allreduce"])
def test_a_compiled_model_trains_with_what_it_was_compiled_with_unless_the_call_says_otherwise(cluster, strategy):
    frozen = compiled(keras.optimizers.SGD(learning_rate=0.0))  # its compiled optimizer changes no weight

    def falls(job) -> float:
        losses = [r["loss"] for r in job.history]
        return float(np.mean(losses[-10:]) / np.mean(losses[:10]))

    kept = wb.train(cluster, frozen, wb.datasets.digits, strategy=strategy, steps=100, seed=7).wait(300)
    assert "accuracy" in kept.history[-1]  # the compiled metrics, and the compiled loss and optimizer:
    assert falls(kept) > 0.8  # a learning rate of 0 learns nothing
    untrained = kept.evaluate(wb.datasets.digits_test)["loss"]  # before the next job (all-reduce engines hold one's)
    given = wb.train(cluster, frozen, wb.datasets.digits, optimizer=keras.optimizers.Adam(0.01), metrics=[],
                     strategy=strategy, steps=100, seed=7).wait(300)
    assert "accuracy" not in given.history[-1]  # the call's metrics win, and its optimizer: from the same initial
    # weights (seed 7), held-out loss 2.3-2.5 where nothing was learned; after 100 steps of Adam(0.01) under 1.2
    trained = given.evaluate(wb.datasets.digits_test)["loss"]
    assert trained < 0.5 * untrained, (trained, untrained)
    if strategy == "allreduce":  # the earlier job's variables were released on the engines: it says so
        with pytest.raises(wb.TrainingError, match="released when a later all-reduce job started"):
            kept.evaluate(wb.datasets.digits_test)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_ended_job_with_callbacks_is_freed_at_once_not_by_the_garbage_collector(cluster, strategy, tmp_path):
    # Freeing a job removes its functions from every task, one RPC each with the GIL held: a job left to the
    # garbage collector was freed in the middle of a later job and froze the kernel (1 to 30 s).
    import gc
    import weakref

    job = fit(cluster, strategy, epochs=2, steps_per_epoch=10, validation_data=wb.datasets.digits_test,
              callbacks=[Recorder(), keras.callbacks.TensorBoard(str(tmp_path))]).wait(300)
    job._thread.join(30)
    gc.disable()
    try:
        freed = weakref.ref(job)
        del job
        assert freed() is None
    finally:
        gc.enable()
