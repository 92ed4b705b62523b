"""The pure pieces of wb.train's Keras loop: epochs from what the user passed, chunks per epoch, epoch logs,
and what the per-worker TensorBoard runs say (staleness, dropped gradients, rates)."""

import keras
import pytest

from workbench.compat.keras import watch_model_reads
from workbench.errors import ConfigurationError
from workbench.telemetry.job_scalars import dropped_gradients, staleness, step_staleness, worker_rates
from workbench.telemetry.tensorboard import run_name
from workbench.training.fit.loop import check_callbacks, epoch_averages, tensorboard_dir, validation_due
from workbench.training.modelling.building import compile_like_the_job
from workbench.training.options import resolve_epochs
from workbench.training.strategies.async_ps import chunks_of


@pytest.mark.parametrize("given, expected", [
    ((None, None, None), (1000, 1, 1000)),  # the old default: 1000 steps, one epoch
    ((300, None, None), (300, 1, 300)),
    ((None, None, 50), (50, 1, 50)),  # Keras: steps_per_epoch alone is one epoch
    ((200, None, 50), (200, 4, 50)),
    ((None, 3, 40), (120, 3, 40)),
    ((120, 3, 40), (120, 3, 40)),
    ((90, 3, None), (90, 3, 30)),
])
def test_resolve_epochs_keeps_keras_meanings(given, expected):
    assert resolve_epochs(*given) == expected


def test_epochs_alone_take_one_pass_of_the_data():
    assert resolve_epochs(None, 2, None, examples_per_epoch=1347, batch_size=64) == (42, 2, 21)


@pytest.mark.parametrize("given, message", [
    ((None, 2, None, None), "pass steps_per_epoch="),
    ((None, 2, None, 10, 64), "fewer than one batch"),
    ((100, 2, 20), "contradicts epochs=2 x steps_per_epoch=20"),
    ((100, 3, None), "does not split into epochs=3"),
    ((90, None, 40), "not a whole number of epochs"),
    ((None, 0, 10), "epochs=0 is not allowed"),
    ((None, 2.5, 10), "epochs=2.5 is not allowed"),
])
def test_resolve_epochs_says_what_to_pass(given, message):
    with pytest.raises(ConfigurationError, match=message):
        resolve_epochs(*given)


def test_no_call_spans_two_epochs():
    assert chunks_of(list(range(25)), 10, epoch=12) == [(0, 10), (10, 2), (12, 10), (22, 2), (24, 1)]
    assert chunks_of(list(range(25)), 10) == [(0, 10), (10, 10), (20, 5)]
    assert chunks_of([3, 4, 5, 9, 10], 10, epoch=5) == [(3, 2), (5, 1), (9, 1), (10, 1)]


def test_epoch_logs_are_plain_means_over_the_epoch():
    records = [{"loss": 1.0, "accuracy": 0.5}, {"loss": 3.0, "accuracy": 1.0}]
    logs = epoch_averages(records, ["accuracy"])
    assert logs == {"loss": 2.0, "accuracy": 0.75} and all(type(v) is float for v in logs.values())
    assert epoch_averages([], ["accuracy"]) == {}
    assert [e for e in range(6) if validation_due(e, 2)] == [1, 3, 5]
    assert [e for e in range(3) if validation_due(e, 1)] == [0, 1, 2]


def test_callbacks_are_checked_and_the_tensorboard_dir_found():
    board = keras.callbacks.TensorBoard("/tmp/somewhere")
    assert check_callbacks(None) == [] and check_callbacks(board) == [board]
    assert tensorboard_dir([board]) == "/tmp/somewhere"
    assert tensorboard_dir([keras.callbacks.History()]) is None
    with pytest.raises(ConfigurationError, match="list of keras.callbacks.Callback"):
        check_callbacks([board, "CSVLogger"])


def test_watching_model_reads_keeps_the_callback_what_it_was():
    reads = []
    stopper = keras.callbacks.EarlyStopping()
    stopper.set_model("the model")
    base = watch_model_reads(stopper, lambda: reads.append(1))
    assert stopper.model == "the model" and reads == [1]
    assert isinstance(stopper, keras.callbacks.EarlyStopping) and type(stopper).__name__ == "EarlyStopping"
    stopper.__class__ = base
    assert stopper.model == "the model" and reads == [1]


def _step(step, worker, start, end, examples=32):
    return {"step": step, "worker": worker, "start": start, "end": end, "examples": examples}


def _judged_once(model, monitor: str):
    """An ``EarlyStopping`` on ``monitor`` for ``model``, after one epoch's end that logged it at 0.5."""
    stopper = keras.callbacks.EarlyStopping(monitor=monitor)
    stopper.set_model(model)
    stopper.on_train_begin()
    stopper.on_epoch_end(0, {monitor: 0.5})
    return stopper


@pytest.mark.parametrize("monitor, rises", [("val_accuracy", True), ("mae", False), ("val_loss", False)])
def test_a_model_compiled_like_the_job_tells_a_monitoring_callback_which_way_is_better(monitor, rises):
    import tensorflow as tf

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    batch = (tf.TensorSpec([None, 64], tf.float32), tf.TensorSpec([None], tf.int64))
    compile_like_the_job(model, keras.optimizers.Adam(), "mse", ["accuracy", "mae"], batch)
    stopper = _judged_once(model, monitor)
    assert stopper.monitor_op is (keras.ops.greater if rises else keras.ops.less) and stopper.best == 0.5


def test_a_model_of_named_inputs_is_built_for_its_callbacks_too():
    import tensorflow as tf

    image, extra = keras.Input((64,), name="image"), keras.Input((3,), name="extra")
    model = keras.Model({"image": image, "extra": extra}, keras.layers.Dense(10)(keras.layers.Concatenate()([image, extra])))
    batch = ({"image": tf.TensorSpec([None, 64], tf.float32), "extra": tf.TensorSpec([None, 3], tf.float32)},
             tf.TensorSpec([None], tf.int64))
    compile_like_the_job(model, keras.optimizers.Adam(), "mse", ["accuracy"], batch)
    assert _judged_once(model, "val_accuracy").monitor_op is keras.ops.greater


def test_a_model_compiled_but_not_built_leaves_a_monitoring_callback_guessing():
    """What ``compile_like_the_job`` is for: Keras finds a metric's direction only among built compiled metrics."""
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss="mse", metrics=["accuracy"])
    with pytest.raises(ValueError, match="automatically determine"):
        _judged_once(model, "val_accuracy")


def test_staleness_counts_the_other_workers_updates_during_a_step():
    records = [_step(0, "w0", 0.0, 1.0), _step(1, "w1", 0.1, 0.5), _step(2, "w1", 0.5, 0.9), _step(3, "w1", 0.9, 1.3)]
    # w0's step ran 0..1 while w1 applied three updates (0.5, 0.9); w1's steps each saw none of w0's but the last
    assert step_staleness(records) == {"w0": [2], "w1": [0, 0, 1]}
    assert staleness(records) == {"w0": 2.0, "w1": pytest.approx(1 / 3)}


def test_dropped_gradients_and_rates_per_worker():
    records = [_step(0, "w0,w1", 0.0, 0.5, 64), _step(1, "w0", 0.5, 1.0, 32), _step(2, "w1", 1.0, 1.25, 32)]
    assert dropped_gradients(records, ["w0", "w1"]) == {"w0": 1, "w1": 1}
    rates = worker_rates(records)
    assert rates["w0"] == {"examples_per_second": pytest.approx(64 / 1.0), "step_time_seconds": pytest.approx(0.5)}
    assert rates["w1"]["examples_per_second"] == pytest.approx(64 / 0.75)
    assert run_name("worker:0") == "worker-0"
