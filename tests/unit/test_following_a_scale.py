"""A ps job that follows a scale up waits until this kernel's connection reaches the new workers, within bounds.

The connection here is the real one, not connected to the stand-in cluster: it cannot take its workers, as when a
task does not answer. What is under test is the job's wait: bounded by ``step_timeout``, ended by ``job.stop()``,
and none when no worker joins.
"""

import threading
import time
from types import SimpleNamespace

import pytest

from workbench.errors import ClusterStateError
from workbench.training.strategies.ps.trainer import PsTrainer

SILENT = "127.0.0.1:1"  # nothing listens on port 1: the task does not answer
BOUND = 5.0  # seconds: each wait below measured 0.3-1.1 s here; the rest is room for a loaded machine


class _Job:
    def __init__(self, step_timeout: float):
        record = SimpleNamespace(name="worker:1", address=SILENT, job="worker")
        self.cluster = SimpleNamespace(tasks=[record], spec_dict={"worker": [SILENT]})
        self.options = SimpleNamespace(recovery=SimpleNamespace(step_timeout=step_timeout))
        self.stopped = threading.Event()

    @property
    def stop_requested(self) -> bool:
        return self.stopped.is_set()

    def describe(self) -> str:
        return "job async-ps-1"


def test_the_wait_for_a_joining_worker_ends_within_step_timeout_naming_the_silent_task():
    job = _Job(step_timeout=1.0)
    started = time.monotonic()
    with pytest.raises(ClusterStateError, match=r"could not take worker:1 within 1 s: .* while worker:1 does not answer"):
        PsTrainer(job)._resize_connection((), ["worker:1"])
    assert time.monotonic() - started < BOUND


def test_a_stop_ends_the_wait_at_once():
    job = _Job(step_timeout=300.0)
    threading.Timer(0.3, job.stopped.set).start()
    started = time.monotonic()
    with pytest.raises(ClusterStateError, match="was stopped while it waited for worker:1"):
        PsTrainer(job)._resize_connection((), ["worker:1"])
    assert time.monotonic() - started < BOUND


def test_workers_that_only_leave_are_not_waited_for():
    job = _Job(step_timeout=300.0)
    started = time.monotonic()
    PsTrainer(job)._resize_connection(("worker:1",), [])
    assert time.monotonic() - started < BOUND
