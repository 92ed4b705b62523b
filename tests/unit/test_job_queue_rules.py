"""The job queue of a cluster: one job runs, the others wait their turn, oldest first (no cluster needed)."""

import gc
import threading

import pytest

from workbench.cluster.jobs import CANCELLED, ENDED, FINISHED, KEEP_ENDED, QUEUED, RUNNING, JobQueue
from workbench.errors import ClusterStateError


class Job:
    """The queue's side of a job: begins in a thread of its own, hands the cluster on when it ends."""

    def __init__(self, queue: JobQueue, name: str):
        self.queue, self.name, self.state = queue, name, QUEUED
        self.begun = threading.Event()
        self._thread = None

    def describe(self) -> str:
        return f"job {self.name} ({self.state})"

    def on_turn(self) -> None:
        self.state = RUNNING
        self.begun.set()

    def finish(self) -> None:
        self.state = FINISHED
        self.queue.ended(self)

    def stop(self, timeout: float) -> None:
        if self.queue.cancel(self) or self.state == QUEUED:
            self.state = CANCELLED
        elif self.state not in ENDED:
            self.state = CANCELLED
            self.queue.ended(self)


def test_the_first_job_begins_and_the_next_waits_for_it():
    queue = JobQueue("c")
    first, second, third = Job(queue, "a-1"), Job(queue, "a-2"), Job(queue, "a-3")
    assert queue.submit(first) is True and first.state == RUNNING
    assert queue.submit(second) is False and queue.submit(third) is False
    assert second.state == third.state == QUEUED and queue.queued == [second, third]
    first.finish()
    assert queue.current is second and second.state == RUNNING and third.state == QUEUED
    second.finish()
    third.finish()
    assert queue.current is None and [j.state for j in queue.all()] == [FINISHED] * 3


def test_refusing_instead_of_queueing_names_the_running_job():
    queue = JobQueue("lab")
    queue.submit(Job(queue, "sync-ps-4"))
    with pytest.raises(ClusterStateError, match=r"cluster 'lab' is training job sync-ps-4 \(running\).*queue=True"):
        queue.submit(Job(queue, "sync-ps-5"), queue=False)
    assert [j.name for j in queue.all()] == ["sync-ps-4"]


def test_a_cancelled_queued_job_never_begins():
    queue = JobQueue("c")
    first, second, third = Job(queue, "a-1"), Job(queue, "a-2"), Job(queue, "a-3")
    for job in (first, second, third):
        queue.submit(job)
    second.stop(0)
    first.finish()
    assert second.state == CANCELLED and not second.begun.is_set() and queue.current is third


def test_stop_all_cancels_the_queue_then_stops_the_running_job_and_says_so():
    queue = JobQueue("c")
    jobs = [Job(queue, f"a-{i}") for i in range(3)]
    for job in jobs:
        queue.submit(job)
    said = queue.stop_all(5)
    assert said == ["cancelled queued job a-1", "cancelled queued job a-2", "stopped job a-0 (running)"]
    assert [j.state for j in jobs] == [CANCELLED] * 3 and queue.current is None


def test_require_idle_refuses_while_a_job_runs_but_not_from_the_jobs_own_thread():
    queue = JobQueue("c")
    queue.require_idle("place a model")  # free: nothing to say
    job = Job(queue, "a-1")
    queue.submit(job)
    with pytest.raises(ClusterStateError, match="cannot place a model while job a-1 .*Wait for the job"):
        queue.require_idle("place a model")
    job._thread = threading.current_thread()  # the job's own recovery re-places its model
    queue.require_idle("place a model")


def test_jobs_are_found_by_name_and_old_ended_ones_are_forgotten():
    queue = JobQueue("c")
    kept = []  # what a notebook holds (its variables, Out[n])
    for i in range(KEEP_ENDED + 5):
        job = Job(queue, f"a-{i}")
        kept.append(job)
        queue.submit(job)
        job.finish()
    listed = queue.all()
    assert len(listed) == KEEP_ENDED + 1  # trimmed at each submit: the newest KEEP_ENDED ended ones and the last
    assert listed[f"a-{KEEP_ENDED + 4}"].state == FINISHED
    with pytest.raises(KeyError, match="no job named 'a-0'"):
        listed["a-0"]


def test_an_ended_job_lives_only_as_long_as_someone_holds_it():
    queue = JobQueue("c")
    running, waiting = Job(queue, "a-1"), Job(queue, "a-2")
    queue.submit(running)
    queue.submit(waiting)
    del waiting  # the queue holds a queued job: it still runs
    running.finish()
    following = queue.current
    assert following.name == "a-2" and following.state == RUNNING
    following.finish()
    del following
    gc.collect()
    assert [j.name for j in queue.all()] == ["a-1"]  # a-2 ended and nothing holds it: its TF state can go
