import json

import pytest

from workbench.cluster.spec import TaskId, cluster_spec_dict, role_layout, tf_config, validate_counts
from workbench.errors import ConfigurationError, UnknownTaskError


@pytest.mark.parametrize("text, expected", [
    ("worker:1", TaskId("worker", 1)),
    ("ps:0", TaskId("ps", 0)),
    (" worker : 12 ", TaskId("worker", 12)),
    ("/job:ps/task:3", TaskId("ps", 3)),
    ("worker/2", TaskId("worker", 2)),
])
def test_task_names_parse(text, expected):
    assert TaskId.parse(text) == expected
    assert TaskId.parse(str(expected)) == expected


@pytest.mark.parametrize("text", ["chief:0", "worker", "worker:-1", "worker:a", "", "ps:0:1"])
def test_bad_task_names_say_how_to_write_one(text):
    with pytest.raises(UnknownTaskError, match="'ps:0' or 'worker:1'"):
        TaskId.parse(text)


def test_task_device_prefix():
    assert TaskId("worker", 1).device == "/job:worker/replica:0/task:1"


def test_role_layout_puts_ps_first():
    assert [str(t) for t in role_layout(2, 3)] == ["ps:0", "ps:1", "worker:0", "worker:1", "worker:2"]
    assert [str(t) for t in role_layout(0, 1)] == ["worker:0"]


@pytest.mark.parametrize("ps, workers, match", [
    (-1, 2, "ps=-1"),
    (1, 0, "at least one worker"),
    (1, -3, "at least one worker"),
    (1.5, 2, "whole number"),
    (1, "2", "whole number"),
    (True, 2, "whole number"),
])
def test_bad_counts_are_rejected_with_advice(ps, workers, match):
    with pytest.raises(ConfigurationError, match=match):
        validate_counts(ps, workers)


def test_cluster_spec_dict_orders_by_index_and_omits_empty_jobs():
    addresses = {TaskId("worker", 1): "h:2", TaskId("worker", 0): "h:1"}
    assert cluster_spec_dict(addresses) == {"worker": ["h:1", "h:2"]}
    addresses[TaskId("ps", 0)] = "h:0"
    assert cluster_spec_dict(addresses) == {"ps": ["h:0"], "worker": ["h:1", "h:2"]}


def test_cluster_spec_dict_rejects_gaps():
    with pytest.raises(ValueError, match="0..1"):
        cluster_spec_dict({TaskId("worker", 0): "a:1", TaskId("worker", 2): "a:2"})


def test_tf_config_names_the_task():
    spec = {"ps": ["h:0"], "worker": ["h:1", "h:2"]}
    config = json.loads(tf_config(spec, TaskId("worker", 1)))
    assert config == {"cluster": spec, "task": {"type": "worker", "index": 1}}
    with pytest.raises(UnknownTaskError):
        tf_config(spec, TaskId("worker", 2))
