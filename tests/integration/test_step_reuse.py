"""Async-ps jobs of one program share a step function on the kernel's connection, each on its own variables."""

import signal

import keras
import numpy as np
import pytest
import tensorflow as tf
from training_helpers import UNTRAINED_LOSS, late_loss, make_model, signal_process, train, wait_for

import workbench as wb

pytestmark = pytest.mark.cluster

STEPS = 120  # enough for the loss to fall far below where it starts


def weights(job) -> list[np.ndarray]:
    return [np.array(w) for w in job.model.get_weights()]


def test_a_second_job_of_the_same_program_calls_the_first_ones_step_function_on_its_own_variables(cluster):
    first = train(cluster, steps=STEPS).wait(300)
    kept, before = weights(first), first.evaluate()
    second = train(cluster, steps=STEPS, seed=11).wait(300)  # a new model and optimizer: same layers, same config
    assert first.state == second.state == "finished"
    assert second.info["reused_step_function"] and second.trainer.fns.traced == 0
    assert late_loss(second.history) < UNTRAINED_LOSS / 3  # it trained its own model...
    assert not all(np.array_equal(a, b) for a, b in zip(weights(second), kept))
    assert all(np.array_equal(a, b) for a, b in zip(weights(first), kept))  # ...and left the first one's alone
    assert first.evaluate() == before


def own_program():
    """A model no other test trains: this module's first sync-ps job is the first of its program on the connection,
    whichever tests ran before it in the process."""
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(37, activation="relu"), keras.layers.Dense(10)])


def test_a_sync_ps_job_run_again_reuses_the_barriers_functions_and_computes_the_same_steps(cluster):
    first = train(cluster, steps=STEPS, strategy="sync-ps", model=own_program).wait(300)
    kept = weights(first)
    again = train(cluster, steps=STEPS, strategy="sync-ps", model=own_program).wait(300)  # the same seed: exact
    assert first.state == again.state == "finished"
    assert not first.info["reused_step_function"] and first.trainer.fns.traced >= 2  # a worker's and the ps's
    assert again.info["reused_step_function"] and again.trainer.fns.traced == 0
    assert [r["aggregated"] for r in again.history] == [2] * STEPS
    np.testing.assert_allclose([r["loss"] for r in again.history], [r["loss"] for r in first.history], rtol=1e-5)
    for a, b in zip(weights(again), kept):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert all(np.array_equal(a, b) for a, b in zip(weights(first), kept))  # two models, each its own
    backup = train(cluster, steps=20, strategy=wb.SyncPS(backup_workers=1), model=own_program).wait(300)  # one a step
    assert backup.info["reused_step_function"] and [r["aggregated"] for r in backup.history] == [1] * 20


def test_a_sweep_over_learning_rates_shares_the_function_and_each_job_steps_at_its_own_rate(cluster):
    train(cluster, steps=10).wait(300)
    still = train(cluster, steps=20, optimizer=keras.optimizers.Adam(0.0)).wait(300)
    moving = train(cluster, steps=STEPS, optimizer=keras.optimizers.Adam(0.02)).wait(300)
    assert still.trainer.fns.reused and moving.trainer.fns.reused
    assert still.trainer.fns.traced == moving.trainer.fns.traced == 0
    assert late_loss(still.history) > UNTRAINED_LOSS / 2  # a rate of 0 leaves the weights where they began
    assert late_loss(moving.history) < UNTRAINED_LOSS / 3


def test_a_model_of_other_layers_traces_its_own(cluster):
    train(cluster, steps=10).wait(300)
    wider = train(cluster, steps=10, model=lambda: keras.Sequential([
        keras.Input((64,)), keras.layers.Dense(48, activation="relu"), keras.layers.Dense(10)]))
    job = wider.wait(300)
    assert job.state == "finished" and not job.trainer.fns.reused and job.trainer.fns.traced == 1


def test_a_layer_class_defined_again_is_another_program(cluster):
    def redefined():  # as a notebook cell run again: the same source, a new class
        class Scaled(keras.layers.Layer):
            def call(self, x):
                return x * 0.5

        return keras.Sequential([keras.Input((64,)), Scaled(), keras.layers.Dense(10)])

    jobs = [train(cluster, steps=10, model=redefined).wait(300) for _ in range(2)]
    assert all(j.state == "finished" and not j.trainer.fns.reused and j.trainer.fns.traced == 1 for j in jobs)


def test_a_step_that_captures_a_variable_of_its_own_keeps_its_function(cluster):
    class Gated(keras.layers.Layer):
        """Scales its input by a ``tf.Variable`` Keras does not track: the step captures it."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.gate = [tf.Variable(1.0, trainable=False)]  # in a list Keras leaves alone

        def call(self, x):
            return x * self.gate[0]

    def gated():
        return keras.Sequential([keras.Input((64,)), Gated(), *make_model().layers])

    jobs = [train(cluster, steps=STEPS, model=gated).wait(300) for _ in range(2)]
    for job in jobs:
        assert job.state == "finished", job.error
        assert not job.trainer.fns.reused and job.trainer.fns.traced == 1
        assert late_loss(job.history) < UNTRAINED_LOSS / 3


def test_a_job_that_ends_while_a_worker_is_rehosted_leaves_the_function_to_the_next(no_leftover_processes):
    """Such a job keeps what it made on the tasks (they do not all answer): not the shared function."""
    with wb.Cluster(ps=1, workers=2, name="wb-test-reuse-kill", progress=False) as cluster:
        train(cluster, steps=20).wait(300)
        job = train(cluster, steps=60)
        wait_for(lambda: job.history or job.state != "running", 120, "the first step")
        with pytest.warns(wb.TaskFaultWarning, match="worker:1"):
            signal_process(cluster.task("worker:1").pid, signal.SIGKILL)  # re-hosted while the job ends
            job.wait(300)
        assert job.state == "finished", job.error
        after = train(cluster, steps=20).wait(300)
        assert after.state == "finished" and after.info["reused_step_function"] and after.trainer.fns.traced == 0
