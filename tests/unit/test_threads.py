"""How TensorFlow's thread pools wait for work: the workbench's choice, and the user's way back to TensorFlow's."""

import subprocess
import sys

import pytest
from tensorflow.core.protobuf import config_pb2

from workbench.cluster.machine.threads import SPINNING_ENV, apply, spinning
from workbench.errors import ConfigurationError


def test_pools_sleep_unless_the_user_asks_for_tensorflows_spinning():
    assert not spinning({})
    assert spinning({SPINNING_ENV: "1"})
    assert not spinning({SPINNING_ENV: "0"})
    assert spinning({SPINNING_ENV: " True "}) and not spinning({SPINNING_ENV: "off"})
    with pytest.raises(ConfigurationError, match=r"WORKBENCH_THREAD_SPINNING='maybe' is not understood: set it to 1"):
        spinning({SPINNING_ENV: "maybe"})
    assert apply(config_pb2.ConfigProto(), {}).experimental.disable_thread_spinning
    assert not apply(config_pb2.ConfigProto(), {SPINNING_ENV: "1"}).experimental.disable_thread_spinning


def test_the_contexts_config_keeps_what_the_user_set_in_it():
    # a fresh Python: the test process's own context is already set up
    code = """
import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.core.protobuf import config_pb2
from workbench.cluster.machine.threads import apply_to_context
context.context()._config = config_pb2.ConfigProto(allow_soft_placement=False, log_device_placement=True)
apply_to_context(context.context(), {})
config = context.context().config
print("RESULT", config.experimental.disable_thread_spinning, config.log_device_placement)
print("RESULT", float(tf.reduce_sum(tf.ones([3]))))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    results = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("RESULT")]
    assert results == [["True", "True"], ["3.0"]]  # the user's placement log is on, and ops run
