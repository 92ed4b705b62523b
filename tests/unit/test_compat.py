"""The fence around TensorFlow's internals: the client's function removal, the GIL released, behaves as TensorFlow's."""

import pytest
import tensorflow as tf
from tensorflow.python.eager import context

from workbench.compat import tensorflow as tf_compat


def test_function_removal_goes_through_the_c_api_on_this_tensorflow():
    assert tf_compat.release_gil_in_function_removal() == ""  # "" once installed; else why TensorFlow's binding stays
    assert context.Context.remove_function.__module__ == tf_compat.__name__


def test_a_removed_function_is_gone_and_a_second_removal_fails_as_tensorflows_does():
    tf_compat.release_gil_in_function_removal()
    concrete = tf.function(lambda x: x + 1).get_concrete_function(tf.TensorSpec([], tf.float32))
    name, definition = concrete.name, concrete.function_def
    assert context.context().has_function(name)
    context.context().remove_function(name)
    assert not context.context().has_function(name)
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-existent function"):
        context.context().remove_function(name.decode() if isinstance(name, bytes) else name)
    context.context().add_function_def(definition)  # back, for the function's own removal when freed
