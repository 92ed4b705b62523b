"""Packed transfers: a step moves one tensor each way per ps, and models with state of their own still train."""

from collections import Counter

import keras
import numpy as np
import pytest
from training_helpers import LOSS, UNTRAINED_LOSS, late_loss, wait_for

import workbench as wb
from workbench.training.modelling.steps import UNROLL

pytestmark = pytest.mark.cluster


def three_layers():
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])


# Passes of the worker's loop to trace before counting, and the profiles of 1.5 s that may take (a loaded machine traces
# fewer steps a profile)
PASSES, PROFILES = 20, 6


def ps_edges(cluster) -> dict[str, Counter]:
    """Per ps task: how often each of its edges to worker:0 fired, over profiles of 1.5 s until the busiest
    fired ``PASSES`` times (at most ``PROFILES`` profiles)."""
    edges: dict[str, Counter] = {}
    for _ in range(PROFILES):
        for send, receive in cluster.profile(seconds=1.5).transfers:
            if send.task.startswith("ps:") and receive.task == "worker:0":
                edges.setdefault(send.task, Counter())[send.transfer_key.split(";")[3]] += 1
        if max((n for counts in edges.values() for n in counts.values()), default=0) >= PASSES:
            break
    return edges


def tensors_per_step(edges: dict[str, Counter]) -> dict[str, float]:
    """Per ps task: how many tensors it sends worker:0 at every step.

    The edges that fire as often as the busiest, per step laid out in a pass of the worker's call (each of
    the ``UNROLL`` steps of a pass is its own copy in the graph, with edges of its own).
    """
    assert set(edges) == {"ps:0", "ps:1"}, f"no transfers traced from both ps tasks: {edges}"
    busiest = max(n for counts in edges.values() for n in counts.values())
    assert busiest >= PASSES, f"too few steps traced to count in {PROFILES} profiles of 1.5 s: {edges}"
    return {task: sum(n > busiest / 2 for n in counts.values()) / UNROLL for task, counts in edges.items()}


def traced_sends(cluster) -> dict[str, float]:
    job = wb.train(cluster, three_layers, wb.datasets.digits, LOSS, keras.optimizers.Adam(1e-3), steps=20_000,
                   batch_size=64, seed=3, telemetry=False)
    try:
        wait_for(lambda: len(job.history) >= 50 or job.state != "running", 120, "50 steps")
        assert job.state == "running", f"the job ended before 50 steps: {job.state}"
        return tensors_per_step(ps_edges(cluster))
    finally:
        job.stop()
        job.wait(120)


def test_each_ps_sends_its_parameters_as_one_tensor_per_step(cluster_two_ps, monkeypatch):
    packed = traced_sends(cluster_two_ps)
    assert packed == {"ps:0": 1, "ps:1": 1}, f"packed: not one tensor per step from each ps: {packed}"
    monkeypatch.setenv("WORKBENCH_PACKED_TRANSFERS", "0")  # every tensor alone, as TensorFlow sends them
    alone = traced_sends(cluster_two_ps)
    assert min(alone.values()) >= 3, f"unpacked: each ps holds three variables, sent one by one: {alone}"


def stateful_model():
    """An embedding (sparse gradients), an L2 penalty, batch statistics and dropout: state beyond the weights."""
    inputs = keras.Input((64,))
    codes = keras.layers.Rescaling(16.0)(inputs)  # the pixel intensities 0..16 again, as embedding indices
    x = keras.layers.Flatten()(keras.layers.Embedding(17, 4)(codes))
    x = keras.layers.Dense(64, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-4))(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Dropout(0.1)(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))


@pytest.mark.parametrize("strategy", ["async-ps", wb.AsyncPS(overlap=True), "sync-ps"],
                         ids=["async-ps", "async-ps-overlapped-reads", "sync-ps"])
def test_a_model_with_batch_statistics_dropout_and_an_embedding_trains_packed(cluster_two_ps, strategy):
    job = wb.train(cluster_two_ps, stateful_model, wb.datasets.digits, LOSS, keras.optimizers.Adam(0.003), steps=400,
                   batch_size=64, seed=7, strategy=strategy, metrics=["accuracy"]).wait(300)
    assert job.state == "finished"
    moving = {w.path.split("/")[-1]: w.numpy() for w in job.model.weights if "moving" in w.path}
    assert np.abs(moving["moving_mean"]).max() > 0.01, "the batch statistics were never written back"
    assert not np.allclose(moving["moving_variance"], 1.0), "the batch statistics were never written back"
    assert late_loss(job.history) < UNTRAINED_LOSS / 3
    assert job.evaluate(wb.datasets.digits_test)["accuracy"] >= 0.90
