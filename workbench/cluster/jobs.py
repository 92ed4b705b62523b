"""How training jobs share a cluster: one at a time, in the order they were submitted.

A job's remote calls and another job's set-up do not mix in one TensorFlow client. Measured with
TF 2.21 (1 ps + 2 workers, an async-ps job running, a second one submitted): the second job's
``tf.function`` is registered on every task by TensorFlow's binding of ``TFE_ContextAddFunction``, which holds the GIL
while it waits for each task to answer a blocking Enqueue RPC (the client's non-streaming enqueue,
``TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE=False``), while the first job's finished calls waited for
that GIL and its other calls for their tasks: the whole process froze (in other runs every remote call
of both jobs stopped answering, with no thread holding the GIL). The kernel now registers functions
with the GIL released (``compat.tensorflow.guard_context_changes``), and a job's set-up still waits on
tasks busy with another job's calls. So a cluster runs one job at a time; a job submitted while another
runs waits in ``queued`` and starts when the cluster is free (``wb.train(..., queue=False)`` refuses instead).

This module knows nothing of training: a job is anything with ``name``, ``state``, ``describe()``,
``on_turn()`` (start running, in a thread of its own, ``_thread``, which calls ``ended(job)`` last) and
``stop(timeout)``. The queue is the one
place every surface (``cluster.jobs``, ``cluster.status()``, ``%wb status``, the dashboards) reads.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable

from ..errors import ClusterStateError

QUEUED, RUNNING, STOPPING, FINISHED, FAILED, CANCELLED = "queued", "running", "stopping", "finished", "failed", "cancelled"
ENDED = (FINISHED, FAILED, CANCELLED)
STATES = (QUEUED, RUNNING, STOPPING, *ENDED)
KEEP_ENDED = 50  # ended jobs listed in cluster.jobs at most (the newest)


class JobList(list):
    """``cluster.jobs``: this process's jobs on a cluster, oldest first; ``jobs["async-ps-3"]`` finds one by name."""

    def __getitem__(self, key):
        if isinstance(key, str):
            for job in self:
                if job.name == key:
                    return job
            raise KeyError(f"no job named {key!r} on this cluster; its jobs: {', '.join(j.name for j in self) or 'none'}")
        return super().__getitem__(key)

    def __repr__(self) -> str:
        return "\n".join(job.describe() for job in self) if self else "(no jobs)"


class JobQueue:
    """The jobs of one cluster: at most one runs; the others wait their turn, oldest first."""

    def __init__(self, cluster_name: str, on_change: Callable[[], None] = lambda: None):
        self.cluster_name = cluster_name
        self.on_change = on_change  # called (outside the lock) when the job that runs changes
        self._lock = threading.Lock()
        # queued and running jobs, then ended ones held weakly: an ended job keeps its TensorFlow state (its
        # functions, its model) for job.model and job.evaluate, so it lives only as long as the user keeps it
        self._jobs: list = []
        self._current = None
        self._waiting: deque = deque()

    @property
    def current(self):
        """The job that runs now (set-up included), or None."""
        return self._current

    @property
    def queued(self) -> list:
        with self._lock:
            return list(self._waiting)

    def all(self) -> JobList:
        with self._lock:
            self._jobs = [entry for entry in self._jobs if _job(entry) is not None]
            return JobList(_job(entry) for entry in self._jobs)

    def submit(self, job, queue: bool = True) -> bool:
        """Run ``job`` now if the cluster is free (True), else queue it (False) or, with ``queue=False``, refuse."""
        with self._lock:
            busy = self._current
            if busy is not None and not queue:
                raise ClusterStateError(
                    f"cluster {self.cluster_name!r} is training {busy.describe()}: a cluster runs one job at a time. "
                    f"Wait for it (job.wait()), stop it (job.stop()), or train with queue=True to start this job when it ends.")
            self._jobs.append(job)
            self._forget_old()
            if busy is None:
                self._current = job
            else:
                self._waiting.append(job)
        if busy is None:
            self.on_change()
            job.on_turn()
        return busy is None

    def ended(self, job) -> None:
        """``job`` (the current one) ended: the next queued job begins."""
        with self._lock:
            self._hold_weakly(job)
            if self._current is not job:
                return
            self._current = self._waiting.popleft() if self._waiting else None
            following = self._current
        self.on_change()
        if following is not None:
            following.on_turn()

    def cancel(self, job) -> bool:
        """Take ``job`` out of the queue; False if it is not waiting there (it runs, or ended)."""
        with self._lock:
            if job in self._waiting:
                self._waiting.remove(job)
                self._hold_weakly(job)
                return True
            return False

    def stop_all(self, timeout: float) -> list[str]:
        """Cancel the queued jobs, then stop the running one (within ``timeout`` s); say what was done."""
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
            for job in waiting:
                self._hold_weakly(job)
            current = self._current
        done = []
        for job in waiting:
            job.stop(0)
            done.append(f"cancelled queued job {job.name}")
        if current is not None and current.state not in ENDED:
            before = current.describe()
            current.stop(timeout)
            done.append(f"stopped {before}")
        return done

    def require_idle(self, what: str) -> None:
        """Refuse ``what`` (TensorFlow work in this kernel on the cluster's tasks) while a job runs: see the module's doc."""
        current = self._current
        if current is not None and getattr(current, "_thread", None) is not threading.current_thread():
            raise ClusterStateError(
                f"cannot {what} while {current.describe()} on cluster {self.cluster_name!r}: registering new TensorFlow "
                "functions while a job's calls are in flight can freeze this kernel. Wait for the job (job.wait()) or stop "
                "it (job.stop()), then try again.")

    def _hold_weakly(self, job) -> None:
        self._jobs = [weakref.ref(entry) if entry is job else entry for entry in self._jobs]

    def _forget_old(self) -> None:
        self._jobs = [entry for entry in self._jobs if _job(entry) is not None]
        ended = [entry for entry in self._jobs if isinstance(entry, weakref.ref)]
        for entry in ended[:max(0, len(ended) - KEEP_ENDED)]:
            self._jobs.remove(entry)


def _job(entry):
    """A job held strongly (queued, running), or weakly once it ended (None when nothing else holds it)."""
    return entry() if isinstance(entry, weakref.ref) else entry
