"""Which jobs may share a step function (``program_key``), and how the kernel keeps them (``StepCache``)."""

from types import SimpleNamespace

import keras
import pytest

from workbench.training.modelling import reuse


def job(width: int = 32, optimizer=None, loss=None):
    """What ``program_key`` reads of a job's ``StepFunctions``, from a fresh model and optimizer."""
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(width, activation="relu"), keras.layers.Dense(10)])
    optimizer = optimizer or keras.optimizers.Adam(0.01)
    optimizer.build(model.trainable_variables)
    return SimpleNamespace(model=model, optimizer=optimizer, metric_fns={"accuracy": keras.metrics.sparse_categorical_accuracy},
                           loss_fn=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True), packing=None,
                           splits=None)


def key(fns):
    return reuse.program_key(fns, reuse.job_variables(fns), ("async",))


def test_the_same_program_built_again_has_the_same_key_whatever_keras_named_it():
    first, second = job(), job()
    assert first.model.layers[0].name != second.model.layers[0].name  # Keras named them apart
    assert key(first) == key(second)


def test_a_learning_rate_held_in_a_variable_is_no_part_of_the_program():
    assert key(job(optimizer=keras.optimizers.Adam(0.01))) == key(job(optimizer=keras.optimizers.Adam(0.3)))


@pytest.mark.parametrize("other", [
    lambda: job(width=48),
    lambda: job(optimizer=keras.optimizers.Adam(0.01, beta_1=0.8)),
    lambda: job(optimizer=keras.optimizers.SGD(0.01)),
    lambda: job(optimizer=keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.01, 100, 0.9))),
    lambda: job(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=False)),
], ids=["width", "beta_1", "optimizer class", "a schedule", "loss config"])
def test_what_changes_the_step_changes_the_key(other):
    assert key(other()) != key(job())


def test_a_loss_without_config_or_hash_cannot_be_told_and_is_never_shared():
    class Unhashable:
        __hash__ = None

        def __call__(self, y, p):
            return p

    assert key(job(loss=Unhashable())) is None


def test_the_cache_hands_a_program_to_one_job_at_a_time_and_keeps_a_few():
    cache = reuse.StepCache()
    a, b, c = "job-a", "job-b", "job-c"  # three jobs: what their traces reach, and who they are
    shared, found = cache.take(("p",), a, a)
    assert not found and shared.current is a and not shared.reused_by(a)
    busy, found = cache.take(("p",), b, b)  # a still calls it: b gets one of its own, never kept
    assert busy is not shared and not found and busy.current is b and busy.private
    shared.current = None  # a ended
    again, found = cache.take(("p",), c, c)
    assert again is shared and found and again.current is c and again.reused_by(c)
    cache.make_private(again)
    assert len(cache) == 0 and not cache.take(("p",), a, a)[1]
    for n in range(reuse.KEPT + 2):
        cache.take((n,), a, a)
    assert len(cache) == reuse.KEPT
    assert cache.settle(1.0) is None
    cache.release_remote()
    assert len(cache) == 0
