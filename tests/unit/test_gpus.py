import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from workbench.cluster.machine.gpus import (
    GROWTH_ENV,
    ORIGINAL_VISIBLE_ENV,
    assign_gpus,
    discover_gpus,
    let_kernel_memory_grow,
    parse_visible_devices,
)
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
    from workbench.training.job.workers import compute_device, input_device

    cpu, gpu = "/job:worker/replica:0/task:1/device:CPU:0", "/job:worker/replica:0/task:1/device:GPU:0"
    with_gpu = _worker([cpu, gpu])
    assert compute_device(with_gpu) == gpu
    assert input_device(with_gpu) == cpu
    assert compute_device(_worker([cpu])) == cpu


def test_the_kernel_lets_its_gpu_memory_grow_unless_the_user_chose():
    environ: dict[str, str] = {}
    let_kernel_memory_grow(environ)
    assert environ == {GROWTH_ENV: "true"}
    chosen = {GROWTH_ENV: "false"}
    let_kernel_memory_grow(chosen)
    assert chosen == {GROWTH_ENV: "false"}


def test_importing_the_workbench_sets_growth_before_any_tensorflow_op():
    """In a fresh Python, as a notebook's first cell would: import, then the user's first op (a Keras optimizer)."""
    code = ("import os; import workbench, keras; from tensorflow.python.eager import context; "
            "print(os.environ.get('TF_FORCE_GPU_ALLOW_GROWTH'), context.context()._context_handle is None); "
            "keras.optimizers.SGD(0.1)")
    env = {k: v for k, v in os.environ.items() if k != GROWTH_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, check=True)
    assert out.stdout.split()[-2:] == ["true", "True"]  # set while TensorFlow had not yet set up any device


@pytest.mark.parametrize("gpus, named", [(2, {"GPU": 2}), (1, {"GPU": 1}), (0, {})])
def test_an_allreduce_group_names_the_gpus_its_worker_sees(gpus, named):
    # MultiWorkerMirroredStrategy puts a worker's replicas on what its resolver names: a resolver that named no GPU
    # had a GPU worker's replica compute on its CPU (found on an H100). TensorFlow cannot fake a GPU on this machine,
    # so the strategy's side is checked by bench/gpu.py on a GPU machine.
    from workbench.training.strategies.allreduce.engine import group_resolver

    resolver = group_resolver(["127.0.0.1:1", "127.0.0.1:2"], 1, gpus)
    assert resolver.num_accelerators() == named
    assert resolver.task_type == "worker" and resolver.task_id == 1 and resolver.rpc_layer == "grpc"
    assert resolver.cluster_spec().as_dict() == {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
