"""The ps strategies' optimizer updates (``training/modelling/fused.py``): Adam and SGD as one TensorFlow kernel per
variable, the same numbers as Keras's own update, and Keras's own update wherever a fused kernel does not apply."""

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from workbench.training.modelling.building import update_where_the_variable_lives  # noqa: E402

STEPS = 6


def _train(optimizer, colocated: bool, gradient_of=None):
    """The variables after ``STEPS`` updates by ``optimizer`` (as the ps strategies set it up, with ``colocated``), and
    the op types of one traced update."""
    variables = [keras.Variable(np.linspace(-1, 1, 12, dtype="float32").reshape(3, 4), name="kernel"),
                 keras.Variable(np.arange(4, dtype="float32") / 10, name="bias")]
    if colocated:
        update_where_the_variable_lives(optimizer)
    optimizer.build(variables)
    rng = np.random.default_rng(0)
    gradients = [[rng.normal(size=v.shape).astype("float32") for v in variables] for _ in range(STEPS)]

    @tf.function
    def step(grads):
        optimizer.apply_gradients(zip(gradient_of(grads, variables) if gradient_of else grads, variables))

    for grads in gradients:
        step([tf.constant(g) for g in grads])
    graph = step.get_concrete_function([tf.TensorSpec(v.shape, "float32") for v in variables]).graph
    ops = [op.type for op in graph.get_operations()]
    return [v.numpy() for v in variables], ops


OPTIMIZERS = {
    "adam": (lambda: keras.optimizers.Adam(0.01), "ResourceApplyAdam"),
    "adam, its own betas and epsilon": (lambda: keras.optimizers.Adam(0.003, beta_1=0.8, beta_2=0.99, epsilon=1e-5),
                                        "ResourceApplyAdam"),
    "adam, a learning-rate schedule": (lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=2, decay_rate=0.5)), "ResourceApplyAdam"),
    "adam, clipped and decayed": (lambda: keras.optimizers.Adam(0.01, clipnorm=0.5, weight_decay=0.01),
                                  "ResourceApplyAdam"),
    "adamw": (lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05), "ResourceApplyAdam"),
    "sgd": (lambda: keras.optimizers.SGD(0.05), "ResourceApplyGradientDescent"),
    "sgd with momentum": (lambda: keras.optimizers.SGD(0.05, momentum=0.9), "ResourceApplyKerasMomentum"),
    "sgd, nesterov": (lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True), "ResourceApplyKerasMomentum"),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_fused_update_gives_kerass_numbers_in_one_kernel_per_variable(name):
    make, kernel = OPTIMIZERS[name]
    keras_weights, keras_ops = _train(make(), colocated=False)
    fused_weights, fused_ops = _train(make(), colocated=True)
    for ours, theirs in zip(fused_weights, keras_weights):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert kernel not in keras_ops
    assert fused_ops.count(kernel) == 2, fused_ops  # one per variable
    assert len(fused_ops) < len(keras_ops), (len(fused_ops), len(keras_ops))


class OwnAdam(keras.optimizers.Adam):
    """A user's subclass: its update may be its own, so it keeps it."""


@pytest.mark.parametrize("make", [lambda: keras.optimizers.Adam(0.01, amsgrad=True), lambda: keras.optimizers.RMSprop(0.01),
                                  lambda: OwnAdam(0.01)], ids=["adam with amsgrad", "rmsprop", "a subclass of adam"])
def test_an_optimizer_without_a_fused_kernel_keeps_kerass_update(make):
    keras_weights, _ = _train(make(), colocated=False)
    weights, ops = _train(make(), colocated=True)
    for ours, theirs in zip(weights, keras_weights):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)
    assert not [op for op in ops if op.startswith("ResourceApply")], ops


def test_a_sparse_gradient_keeps_kerass_update():
    def sparse(grads, variables):  # the kernel's gradient as rows (an embedding's), the bias's dense
        return [tf.IndexedSlices(grads[0][:2], tf.constant([0, 2]), tf.constant([3, 4])), grads[1]]

    keras_weights, _ = _train(keras.optimizers.Adam(0.01), colocated=False, gradient_of=sparse)
    weights, ops = _train(keras.optimizers.Adam(0.01), colocated=True, gradient_of=sparse)
    for ours, theirs in zip(weights, keras_weights):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert ops.count("ResourceApplyAdam") == 1, ops  # the bias's; the kernel's rows go through Keras
