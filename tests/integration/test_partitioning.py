"""Variables over several ps tasks: a large variable is partitioned, each shard updated on its own ps."""

import keras
import numpy as np
import pytest
from training_helpers import LOSS

import workbench as wb

pytestmark = pytest.mark.cluster

PS0, PS1 = "/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0"
ACCURACY = 0.80  # what a partitioned model must reach on held-out digits (distributions measured: see the test)


def wide_model():
    # hidden kernel: 64 x 512 float32 = 128 KiB, above the 64 KiB threshold below; the rest is small
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(512, activation="relu", name="hidden"),
        keras.layers.Dense(10, name="logits"),
    ])


def _train(cluster, strategy=wb.AsyncPS, partition_bytes=64 * 1024, **kwargs):
    options = dict(optimizer=keras.optimizers.Adam(0.005), metrics=["accuracy"], steps=300, batch_size=64, seed=3)
    options.update(kwargs)
    return wb.train(cluster, wide_model, wb.datasets.digits, LOSS, strategy=strategy(partition_bytes=partition_bytes), **options)


@pytest.mark.parametrize("strategy", [wb.AsyncPS, wb.SyncPS], ids=["async-ps", "sync-ps"])
def test_large_variable_is_split_over_the_ps_tasks_and_trains(cluster_two_ps, strategy):
    job = _train(cluster_two_ps, strategy=strategy).wait(300)
    assert list(job.info["partitioned"].values()) == [[PS0, PS1]] or list(job.info["partitioned"].values()) == [[PS1, PS0]]
    kernel = job.trainer.model_on_tasks().get_layer("hidden").kernel
    assert sorted(s.device for s in kernel.value.variables) == [PS0, PS1]
    assert [int(s.shape[0]) for s in kernel.value.variables] == [32, 32]
    # optimizer slots of each shard live on that shard's ps
    for variable in job.trainer.optimizer.variables:
        if "hidden_kernel_part" in variable.path:
            part = int(variable.path.split("_part_")[1][0])
            assert variable.value.device == kernel.value.variables[part].device
    rows = [r for r in wb.placement(job).rows if r.layer == "hidden" and r.variable == "kernel"]
    assert sorted(rows[0].task.split(", ")) == ["ps:0", "ps:1"]
    # It learned (chance: 0.10). Held-out accuracy over 20 runs of each with one core kept busy: sync-ps 0.98 every
    # time; async-ps 0.958 to 0.984 and once 0.900; under three test processes on the two cores, 0.893 and 0.898.
    accuracy = job.evaluate(wb.datasets.digits_test)["accuracy"]
    assert accuracy >= ACCURACY
    x, y = wb.datasets.digits_arrays("test")  # the trained weights in the kernel's model give the same answers
    assert float(np.mean(np.argmax(job.model.predict(x, verbose=0), axis=1) == y)) == pytest.approx(accuracy, abs=0.01)


def test_partitioned_checkpoints_resume(cluster_two_ps, tmp_path):
    first = _train(cluster_two_ps, strategy=wb.SyncPS, steps=100, checkpoint=wb.Checkpoint(tmp_path, every=50)).wait(300)
    second = _train(cluster_two_ps, strategy=wb.SyncPS, steps=150, checkpoint=wb.Checkpoint(tmp_path, resume=True)).wait(300)
    assert second.start_step == 100
    assert np.mean([r["loss"] for r in second.history[:10]]) < np.mean([r["loss"] for r in first.history[:10]]) / 3


def test_below_the_threshold_nothing_is_split(cluster_two_ps):
    job = _train(cluster_two_ps, partition_bytes=0, steps=5).wait(120)
    assert job.info["partitioned"] == {}
    assert set(job.info["ps_bytes"]) == {PS0, PS1}  # whole variables spread by size
