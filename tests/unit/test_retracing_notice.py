"""TensorFlow's retracing warning stays out of cells for the workbench's own functions made anew on purpose only
(per-job step functions, a re-hosting's round trip between the tasks)."""

import logging

import tensorflow as tf

from workbench.compat.tensorflow import quiet_retracing_of
from workbench.training.modelling.steps import steps_in_one_call


class _Seen(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _one_step(x, y, state):
    stamp = tf.timestamp()
    return tf.reduce_sum(x) + tf.reduce_sum(y), tf.zeros([1]), [], stamp, stamp


def _user_function():
    @tf.function
    def users(x):
        return x * 2

    return users


def _own_function_made_anew():
    """As the connection makes one per re-hosting: registered by its qualified name, then wrapped."""

    def round_trip(x):
        return x + 1.0

    quiet_retracing_of(round_trip.__qualname__)
    return tf.function(round_trip, autograph=False)


def test_new_step_functions_per_job_do_not_warn_but_a_users_loop_still_does():
    logger = logging.getLogger("tensorflow")
    seen = _Seen()
    logger.addHandler(seen)
    try:
        data = tf.data.Dataset.from_tensors((tf.ones([2]), tf.ones([2]))).repeat()
        for _ in range(7):  # as seven short jobs: one new function per job, traced once
            steps_in_one_call(_one_step, 1)(iter(data), tf.constant(1), (), ())
            _own_function_made_anew()(tf.constant(1.0))
        ours = [m for m in seen.messages if "retracing" in m]
        for _ in range(7):  # the mistake the warning is for: a tf.function made anew in a loop
            _user_function()(tf.constant(1.0))
        theirs = [m for m in seen.messages if "retracing" in m and "_user_function.<locals>.users" in m]
    finally:
        logger.removeHandler(seen)
    assert ours == [], ours
    assert theirs, "TensorFlow's warning for a user's own retracing function must still show"


def test_a_validation_function_per_job_does_not_warn_where_no_step_function_was_made():
    """sync-ps validates through ``evaluation_function`` without ever making ``steps_in_one_call``'s function: the
    filter must come with the validation function itself (a script's sync-ps sweep printed the warning)."""
    import keras

    from workbench.compat import tensorflow as tf_compat
    from workbench.training.modelling.steps import StepFunctions

    logger = logging.getLogger("tensorflow")
    installed = [f for f in logger.filters if isinstance(f, tf_compat._OwnRetracing)]
    for existing in installed:  # as in a process that has made no step function yet
        logger.removeFilter(existing)
    named = set(tf_compat._OWN_FUNCTIONS)
    tf_compat._OWN_FUNCTIONS.clear()
    seen = _Seen()
    logger.addHandler(seen)
    try:
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        functions = StepFunctions(model, keras.optimizers.SGD(), keras.losses.MeanSquaredError(), {})
        data = tf.data.Dataset.from_tensors((tf.ones([2, 2]), tf.ones([2, 1])))
        for _ in range(7):  # as seven jobs' validation, one function each
            loss, count = functions.evaluation_function(lambda: data)()
        assert float(count) == 2.0 and loss.shape == (1,)
    finally:
        logger.removeHandler(seen)
        tf_compat._OWN_FUNCTIONS.update(named)
        for existing in installed:
            if existing not in logger.filters:
                logger.addFilter(existing)
    assert [m for m in seen.messages if "retracing" in m] == []
