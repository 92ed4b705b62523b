"""What the threads of a job's workers share: their own TensorFlow executors, and the states of their slots.

Each worker of a ps job has a thread in the kernel bound to it (its *slot*): the thread makes the
worker's remote calls, one after the other, on an executor of its own. A slot is ``active``
(it takes work), ``lost`` (its task is gone and will not come back), ``recovering`` (its task is
being re-hosted) or ``dropped`` (its task hangs or straggles, and the job goes on without it until
it answers again).
"""

from __future__ import annotations

from collections.abc import Callable

from ..compat import tensorflow as tf_compat

ACTIVE, LOST, RECOVERING, DROPPED = "active", "lost", "recovering", "dropped"
TICK_SECONDS = 0.05  # how often a job's loop looks at its calls, its tasks' health and its queue
THREAD_JOIN_SECONDS = 30.0  # how long a finished run waits for its workers' threads (hung calls are not waited for)


class WorkersChanged(Exception):
    """A run stopped at a step boundary because the cluster was scaled (``Job.rescale``); the job adopts the new
    workers and starts the next run. ``drained``: when the last call of the old workers was back (time.time())."""

    def __init__(self, drained: float):
        super().__init__("the cluster's workers changed")
        self.drained = drained


def compute_device(record) -> str:
    """Where a worker task's steps run: its first GPU if its server offers one (``gpus_per_worker``), else its CPU."""
    gpus = [d for d in record.devices if "/device:GPU:" in d]
    return gpus[0] if gpus else input_device(record)


def input_device(record) -> str:
    """Where a worker task's input pipeline runs: its CPU (tf.data has no GPU kernels)."""
    return f"{record.task.device}/device:CPU:0"


def own_executor(work: Callable) -> Callable:
    """Run a worker's thread on its own TF executor.

    Threads of one process share TensorFlow's default executor, which runs their remote calls one
    after the other: a worker that is slow to produce its batch then holds up every other
    worker's calls (measured: the fast workers' parameter pulls took 93 ms instead of 7 behind a
    straggler's 110 ms step). ClusterCoordinator does the same for the same reason. How the thread
    switches executors (TensorFlow's raw handles) is ``compat.tensorflow.run_on_own_executor``'s.
    """
    return tf_compat.run_on_own_executor(work)
