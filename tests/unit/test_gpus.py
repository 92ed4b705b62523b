from types import SimpleNamespace

import pytest

from workbench.cluster.machine.gpus import ORIGINAL_VISIBLE_ENV, assign_gpus, discover_gpus, parse_visible_devices
from workbench.cluster.spec import TaskId
from workbench.errors import ConfigurationError

PS0, W0, W1, W2 = TaskId("ps", 0), TaskId("worker", 0), TaskId("worker", 1), TaskId("worker", 2)


@pytest.mark.parametrize("value, expected", [
    (None, None), ("", []), ("0,1", ["0", "1"]), (" 2 , 3 ", ["2", "3"]), ("-1", []), ("0,-1,2", ["0"]),
    ("GPU-8f2a,GPU-77", ["GPU-8f2a", "GPU-77"]),
])
def test_parse_visible_devices(value, expected):
    assert parse_visible_devices(value) == expected


def test_discovery_prefers_what_the_scheduler_made_visible():
    assert discover_gpus({"CUDA_VISIBLE_DEVICES": "4,5"}) == ["4", "5"]
    # the engine bootstrap hid GPUs for a CPU pool but kept the original list
    assert discover_gpus({"CUDA_VISIBLE_DEVICES": "", ORIGINAL_VISIBLE_ENV: "1,2"}) == ["1", "2"]


def test_discovery_without_variables_asks_the_driver():
    # this machine has no NVIDIA driver: the answer is an empty list, not an error
    assert isinstance(discover_gpus({}), list)


def test_workers_get_disjoint_gpus_and_ps_gets_none():
    plan = assign_gpus({"a": [PS0, W0, W1]}, {"a": ["0", "1", "2", "3"]}, 2)
    assert plan == {PS0: [], W0: ["0", "1"], W1: ["2", "3"]}


def test_each_host_assigns_its_own_gpus():
    plan = assign_gpus({"a": [W0, W1], "b": [PS0, W2]}, {"a": ["0", "1"], "b": ["0"]}, 1)
    assert plan == {W0: ["0"], W1: ["1"], PS0: [], W2: ["0"]}


def test_scaling_skips_gpus_in_use():
    plan = assign_gpus({"a": [W2]}, {"a": ["0", "1", "2"]}, 1, in_use={"a": ["0", "1"]})
    assert plan == {W2: ["2"]}


def test_zero_gpus_per_worker_assigns_nothing():
    assert assign_gpus({"a": [PS0, W0]}, {"a": []}, 0) == {PS0: [], W0: []}


def test_too_few_gpus_names_host_and_remedy():
    with pytest.raises(ConfigurationError, match=r"host 'a' has 3 free GPU\(s\).*need 2 each \(4 in all\).*lower gpus_per_worker"):
        assign_gpus({"a": [W0, W1]}, {"a": ["0", "1", "2"]}, 2)


def _worker(devices: list[str]):
    return SimpleNamespace(task=TaskId("worker", 1), devices=devices)


def test_a_worker_computes_on_its_gpu_and_reads_its_input_on_its_cpu():
    from workbench.training.workers import compute_device, input_device

    cpu, gpu = "/job:worker/replica:0/task:1/device:CPU:0", "/job:worker/replica:0/task:1/device:GPU:0"
    with_gpu = _worker([cpu, gpu])
    assert compute_device(with_gpu) == gpu
    assert input_device(with_gpu) == cpu
    assert compute_device(_worker([cpu])) == cpu
