"""How TensorFlow's thread pools wait for work and how many threads compute: the workbench's choices, and the
user's way back to TensorFlow's."""

import os
import subprocess
import sys

import pytest
from tensorflow.core.protobuf import config_pb2

from workbench.cluster.machine import threads
from workbench.cluster.machine.threads import INTRA_OP_ENV, SPINNING_ENV, apply, intra_op_share, spinning
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


def test_a_task_takes_its_share_of_the_machines_cores_unless_tensorflows_own_setting_is_given(monkeypatch):
    assert intra_op_share(3, {}, cores=2) == 1  # 1 ps + 2 workers on 2 cores: one thread each, never none
    assert intra_op_share(3, {}, cores=8) == 2 and intra_op_share(1, {}, cores=8) == 8
    assert intra_op_share(0, {}, cores=4) == 4
    assert intra_op_share(3, {INTRA_OP_ENV: "4"}, cores=8) == 0  # TensorFlow reads it and sizes the pools itself
    monkeypatch.setitem(threads._SHARE, "intra_op", 0)
    assert threads.share_cores(1, {}) == len(os.sched_getaffinity(0))
    assert apply(config_pb2.ConfigProto(), {}).intra_op_parallelism_threads == len(os.sched_getaffinity(0))
    given = config_pb2.ConfigProto(intra_op_parallelism_threads=5)
    assert apply(given, {}).intra_op_parallelism_threads == 5  # a config that names its threads keeps them
    threads.share_cores(3, {INTRA_OP_ENV: "4"})
    assert apply(config_pb2.ConfigProto(), {}).intra_op_parallelism_threads == 0
