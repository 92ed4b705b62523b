"""Interactive placement and model parallelism on a real cluster: cluster.connect/device, wb.place, wb.placement."""

import socket
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf
from training_helpers import LOSS

import workbench as wb

pytestmark = pytest.mark.cluster

W0, W1 = "/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:0"


def two_layer_model():
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(32, activation="relu", name="hidden"),
        keras.layers.Dense(10, name="logits"),
    ])


def test_device_scope_runs_ops_and_keeps_variables_on_the_named_task(cluster):
    assert cluster.connect() is cluster
    with cluster.device("worker:1"):
        v = tf.Variable(tf.ones([3]))
        doubled = v * 2
    assert v.device == W1 and doubled.device == W1
    assert doubled.numpy().tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(wb.UnknownTaskError, match="has no task worker:7"):
        cluster.device("worker:7")
    with pytest.raises(wb.ConfigurationError, match="has no device GPU:0"):
        cluster.device("worker:0", "GPU")


def test_place_splits_layers_and_trains_with_each_backward_pass_on_its_task(cluster):
    cluster.connect()
    placed = wb.place(two_layer_model, {"hidden": "worker:0", "logits": "worker:1"})
    table = wb.placement(placed)
    assert table.by_layer() == {"hidden": "worker:0", "logits": "worker:1"}
    assert {r.device for r in table.rows if r.layer == "hidden"} == {W0}
    assert {r.device for r in table.rows if r.layer == "logits"} == {W1}
    # each layer's gradient ops are placed with its forward ops, not on the caller
    assert table.backward == {"hidden": [W0], "logits": [W1]}
    assert "hidden" in str(table) and "backward on" in str(table)
    # forward ops run on the layer's task
    with cluster.device("worker:0"):
        out = placed(tf.zeros([2, 64]))
    assert out.device == W1

    job = placed.train(wb.datasets.digits, LOSS, keras.optimizers.Adam(0.01), metrics=["accuracy"], steps=300,
                       batch_size=64, seed=7).wait(300)
    assert job.info["layers"] == {"hidden": "worker:0", "logits": "worker:1"}
    assert job.info["per_worker_batch_size"] == 64
    assert [r["step"] for r in job.history] == list(range(300))
    assert job.evaluate(wb.datasets.digits_test)["accuracy"] >= 0.90
    # optimizer slots live beside their variables
    for variable in job.trainer.optimizer.variables:
        if "hidden" in variable.path:
            assert variable.value.device == W0
        if "logits" in variable.path:
            assert variable.value.device == W1
    x, y = wb.datasets.digits_arrays("test")
    local = job.model
    assert float(np.mean(np.argmax(local.predict(x, verbose=0), axis=1) == y)) >= 0.90


def test_placement_of_a_ps_job_and_bad_layouts(cluster):
    job = wb.train(cluster, two_layer_model, wb.datasets.digits, LOSS, steps=5, seed=1).wait(120)
    assert set(wb.placement(job).by_layer().values()) == {"ps:0"}
    cluster.connect()
    with pytest.raises(wb.ConfigurationError, match="no layer.*'hiddn'.*its layers are hidden, logits"):
        wb.place(two_layer_model, {"hiddn": "worker:0"})
    with pytest.raises(wb.UnknownTaskError, match="worker:9"):
        wb.place(two_layer_model, {"hidden": "worker:9"})
    with pytest.raises(wb.ConfigurationError, match="needs a placed model"):
        wb.train(cluster, two_layer_model, wb.datasets.digits, LOSS, strategy="model-parallel")


def test_an_update_that_fails_on_a_task_says_the_kernel_lost_its_devices_and_the_next_update_restores_them(cluster):
    """A re-hosted task whose new server closes every connection: TensorFlow's update of the kernel's connection
    removes that task and fails to add it back. The error names the task whose devices the connection lost, and the
    next update, with the task's real address, brings them back."""
    from workbench.cluster.process import connection

    cluster.connect()
    record = cluster.task("worker:1")
    address = record.address
    refusing = socket.create_server(("127.0.0.1", 0))
    refusing.settimeout(0.2)
    done = threading.Event()

    def close_each() -> None:  # accepts (so the task looks up), then closes: no TensorFlow server there
        while not done.is_set():
            try:
                refusing.accept()[0].close()
            except OSError:
                pass

    closer = threading.Thread(target=close_each, daemon=True)
    closer.start()
    try:
        record.address = f"127.0.0.1:{refusing.getsockname()[1]}"
        with pytest.raises(wb.ClusterStateError, match=r"left without the devices of worker:1: an op placed there"):
            connection.refresh(cluster, "worker:1", timeout=30)
    finally:
        record.address = address
        done.set()
        closer.join(5)
        refusing.close()
    assert connection.refresh(cluster, "worker:1", timeout=60)
    with cluster.device("worker:1"):
        assert (tf.ones([2]) * 2).numpy().tolist() == [2.0, 2.0]
