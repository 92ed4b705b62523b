"""A job's own thread: set up when its turn comes, train (restoring after a lost ps), end, hand the cluster on.

``Job.start`` submits the job to its cluster's queue; when its turn comes the queue starts the thread
that runs ``drive(job)``. Everything strategy-specific is the job's trainer's: ``job.trainer.set_up`` and
``job.trainer.run``.
"""

from __future__ import annotations

from dataclasses import replace

from ...cluster.health import LOST, RECOVERING
from ...cluster.health import RUNNING as RUNNING_TASK
from ...cluster.jobs import CANCELLED, FAILED, FINISHED
from ...cluster.process import connection
from ...errors import ClusterStateError, TrainingError, WorkbenchError
from ..options import validate
from .checkpoints import Cadence, save_or_lost
from .recovery import Supervisor, TaskLost, classify, restore_after_loss
from .workers import WorkersChanged

TASKS_READY_SECONDS = 120.0  # how long a job's start waits for a task being re-hosted


def _use_dtype_policy(policy) -> None:
    """Keras's global dtype policy (mixed precision) lives per thread: the job's thread takes its caller's."""
    import keras

    keras.config.set_dtype_policy(policy)


def drive(job) -> None:
    """The job's thread: set up (now that the cluster is this job's), train, end, hand the cluster on."""
    job.supervisor = Supervisor(job)
    state = FAILED
    try:
        try:
            _prepare(job)
            job.loop.begin()  # the callbacks' on_train_begin: a mistake there is raised by wb.train too
        except BaseException as exc:
            job.setup_error = exc if isinstance(exc, Exception) else _as_error(job, exc)
            raise
        job.set_up_done.set()
        _train_with_recovery(job)
        stopped = job.stop_requested
        job.loop.end(finished=not stopped)  # on_train_end: a callback raising there fails the job
        state = CANCELLED if stopped else FINISHED
    except BaseException as exc:  # noqa: BLE001 - kept for wait() to raise in the caller's thread
        if job.stop_requested:
            state = CANCELLED  # what a stop interrupted is not the job's error
        else:
            job.error = job.setup_error or _as_error(job, exc)
    finally:
        if state != FINISHED:
            _end_loop_quietly(job)
        job.supervisor.close()
        job.supervisor = None  # no cycle left: an ended job nobody holds is freed at once, TF state and all
        try:
            # the dashboards and the panel learn of the end now: the clean-up below trains nothing (an end told after
            # it drew the seconds it took, under load over a second, as a fall to zero after the last step)
            job.report_progress(state)
            if _every_task_answers(job):  # freeing a function is an RPC to every task: one that hangs would block it
                job.release_training()
                connection.free_garbage()  # what the job let go of leaves the tasks now, from this thread
            job.trainer.free_engines()
        finally:
            job.state = state
            job.cluster.job_queue.ended(job)  # before waiters wake: the cluster is free, or the next job's
            job.mark_ended(state)


def _every_task_answers(job) -> bool:
    """No task of the cluster is silent, lost or being re-hosted, and the job gave up on none (a stopped process
    that answers nothing): otherwise what the job holds stays until the cluster stops and its tasks are gone."""
    return not job.lost_workers and all(r.state == RUNNING_TASK for r in job.cluster.tasks)


def _end_loop_quietly(job) -> None:
    """A job that failed or was stopped: no ``on_train_end`` (as ``model.fit`` on an error), files closed."""
    try:
        job.loop.end(finished=False)
    except Exception:  # noqa: BLE001 - the job's own error is the one to report
        pass


def _prepare(job) -> None:
    """The set-up of ``wb.train``, done when the job's turn comes: the cluster's workers are those of now."""
    cluster, options = job.cluster, job.options
    if cluster.state != "running":
        raise ClusterStateError(f"cannot train on cluster {cluster.name!r}: it is {cluster.state}.")
    _tasks_ready(job)
    if options.strategy.data_parallel:
        job.workers = [r for r in cluster.tasks if r.job == "worker"]
        if len(job.workers) != options.num_workers:  # scaled while the job waited in the queue
            job.options = validate(replace(options, num_workers=len(job.workers)))
    _use_dtype_policy(job.dtype_policy)
    job.trainer.set_up()


def _tasks_ready(job) -> None:
    """Begin on tasks that serve: wait for a re-hosting still under way (the previous job lost a worker and
    ended before it was back), and re-host a task found lost (``Recovery.rehost``) or say which one is."""
    if not job.cluster.settle(TASKS_READY_SECONDS):
        raise ClusterStateError(f"cluster {job.cluster.name!r} was still starting, scaling or re-hosting a task after "
                                f"{TASKS_READY_SECONDS:.0f} s: check cluster.status().")
    down = [r for r in job.cluster.tasks if r.state in (LOST, RECOVERING)
            or (r.state == RUNNING_TASK and connection.connect_problem(r.address, 2.0))]
    for record in down:
        if not job.options.recovery.rehost:
            raise ClusterStateError(
                f"{record.name} of cluster {job.cluster.name!r} is lost ({record.note or 'its server refuses connections'})"
                f": re-host it with cluster.replace_task({record.name!r}), or train with recovery=wb.Recovery() (the default).")
        job.cluster.replace_task(record.name, refresh_connection=job.trainer.uses_connection)


def _train_with_recovery(job) -> None:
    while True:
        job.cadence = Cadence(job)  # from this run's start: after a restore, from the restored step
        try:
            job.trainer.run()
            if job.options.checkpoint and not job.stop_requested:
                save_or_lost(job)
            return
        except WorkersChanged as changed:
            job.adopt_workers(changed.drained)  # the cluster was scaled: the next run has its new workers
        except TaskLost as lost:
            if not job.options.recovery.rehost or job.stop_requested:
                raise lost.error from None
            restore_after_loss(job, lost)


def _as_error(job, exc: BaseException) -> BaseException:
    if isinstance(exc, WorkbenchError):
        return exc
    if isinstance(exc, Exception):
        return classify(job, exc, "the job's driver")
    return TrainingError(f"training failed: {type(exc).__name__}: {exc}")
