"""What the threads of a job's workers share: their own TensorFlow executors, and the states of their slots.

Each worker of a ps job has a thread in the kernel bound to it (its *slot*): the thread makes the
worker's remote calls, one after the other, on an executor of its own. A slot is ``active``
(it takes work), ``lost`` (its task is gone and will not come back), ``recovering`` (its task is
being re-hosted) or ``dropped`` (its task hangs or straggles, and the job goes on without it until
it answers again).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from ...compat import tensorflow as tf_compat

ACTIVE, LOST, RECOVERING, DROPPED = "active", "lost", "recovering", "dropped"
TICK_SECONDS = 0.05  # how often a job's loop looks at its calls, its tasks' health and its queue
THREAD_JOIN_SECONDS = 30.0  # how long a finished run waits for its workers' threads (hung calls are not waited for)
RELEASE_POLL_SECONDS = 0.002  # how often a thread waiting for the next epoch looks again


class WorkersChanged(Exception):
    """A run stopped at a step boundary because the cluster was scaled (``Job.rescale``); the job adopts the new
    workers and starts the next run. ``drained``: when the last call of the old workers was back (time.time())."""

    def __init__(self, drained: float):
        super().__init__("the cluster's workers changed")
        self.drained = drained


class CallGate:
    """Holds a run's calls at a chunk boundary while this kernel's connection changes under them.

    A connection update (``update_server_def``, after a re-hosting) made beside a call blocked on the ps
    lost what the kernel had made there ("Unable to find the relevant tensor remote_handle" at a later
    step). The calls of a sync-ps chunk wait on each other (the ps's ``aggregate`` for the workers'
    gradients, the workers for its tokens), so they cannot stop one by one: ``quiet()`` lets every call
    of the chunks begun so far go on, holds those of later chunks, and runs its body once none is in
    flight. A thread makes each of its calls inside ``call(chunk, over)``, ``chunk`` the chunk's first step:
    steps, unlike a run's chunk numbers, keep counting from one run of the job to the next (a scale starts a
    new run while a re-hosting begun in the old one is still under way).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._in_flight = 0
        self._highest = -1  # the latest chunk (its first step) a call was made for
        self._held_from: int | None = None  # calls of this chunk and later wait
        self._changing = False
        self._one_at_a_time = threading.Lock()  # two re-hostings' updates: one after the other

    @contextlib.contextmanager
    def call(self, chunk: int, over: Callable[[], bool]) -> Iterator[bool]:
        """Around one call of ``chunk`` (its first step): waits while the gate holds it; yields False (make no call) once ``over()``."""
        if not self._enter(chunk, over):
            yield False
            return
        try:
            yield True
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    def _enter(self, chunk: int, over: Callable[[], bool]) -> bool:
        """Wait until a call of ``chunk`` may be made and count it in flight; False (not counted) once ``over()``."""
        with self._cond:
            while self._changing or (self._held_from is not None and chunk >= self._held_from):
                if over():
                    return False
                self._cond.wait(TICK_SECONDS)
            self._in_flight += 1
            self._highest = max(self._highest, chunk)
            return True

    @contextlib.contextmanager
    def quiet(self, timeout: float) -> Iterator[None]:
        """Run the body with no call in flight: the chunks begun so far end first (at most ``timeout`` s; after
        that the body runs anyway, beside what is still in flight: a hung call must not hold it for ever)."""
        deadline = time.monotonic() + timeout
        with self._one_at_a_time, self._quiet_until(deadline):
            yield

    @contextlib.contextmanager
    def _quiet_until(self, deadline: float) -> Iterator[None]:
        with self._cond:
            self._held_from = self._highest + 1
            while self._in_flight and time.monotonic() < deadline:
                self._cond.wait(min(TICK_SECONDS, max(0.0, deadline - time.monotonic())))
            self._changing = True
        try:
            yield
        finally:
            with self._cond:
                self._changing, self._held_from = False, None
                self._cond.notify_all()


def compute_device(record) -> str:
    """Where a worker task's steps run: its first GPU if its server offers one (``gpus_per_worker``), else its CPU."""
    gpus = [d for d in record.devices if "/device:GPU:" in d]
    return gpus[0] if gpus else input_device(record)


def input_device(record) -> str:
    """Where a worker task's input pipeline runs: its CPU (tf.data has no GPU kernels)."""
    return f"{record.task.device}/device:CPU:0"


def trim_engines(cluster) -> None:
    """Return what the cluster's engines freed to the system (a memory-capped container counts it); no waiting."""
    from ...cluster.machine.memory import trim_memory

    try:
        alive = set(cluster.client.ids)
        engines = [r.engine_id for r in cluster.tasks if r.engine_id in alive]
        if engines:
            cluster.client[engines].apply_async(trim_memory)
    except Exception:  # noqa: BLE001 - an optimisation: a stopped cluster or a lost engine needs none
        pass


def own_executor(work: Callable) -> Callable:
    """Run a worker's thread on its own TF executor.

    Threads of one process share TensorFlow's default executor, which runs their remote calls one
    after the other: a worker that is slow to produce its batch then holds up every other
    worker's calls (measured: the fast workers' parameter pulls took 93 ms instead of 7 behind a
    straggler's 110 ms step). ClusterCoordinator does the same for the same reason. How the thread
    switches executors (TensorFlow's raw handles) is ``compat.tensorflow.run_on_own_executor``'s.
    """
    return tf_compat.run_on_own_executor(work)


def wait_until(ready: Callable[[], bool], give_up: Callable[[], bool], timeout: float | None) -> bool:
    """Poll until ``ready()`` (True), or ``give_up()`` or ``timeout`` s (False). ``timeout=None`` waits for
    ``give_up()`` only: for threads of a run, which the run's end (``halt``) releases."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not ready():
        if give_up() or (deadline is not None and time.monotonic() > deadline):
            return False
        time.sleep(RELEASE_POLL_SECONDS)
    return True


def wait_for_event(event, timeout: float | None, interrupted: Callable[[], str], timed_out: Callable[[], str]) -> None:
    """Wait for ``event`` in short steps, so that an interrupt (Jupyter's stop button) gets through: a
    ``KeyboardInterrupt`` saying ``interrupted()``; past ``timeout`` s (None: none), a ``TimeoutError`` saying ``timed_out()``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while not event.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(timed_out())
            event.wait(0.2 if left is None else min(0.2, left))
    except KeyboardInterrupt:
        raise KeyboardInterrupt(interrupted()) from None
