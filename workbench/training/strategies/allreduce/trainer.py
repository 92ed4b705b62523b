"""``strategy="allreduce"``: synchronous data parallelism with MultiWorkerMirroredStrategy on the engines.

The kernel does not join the all-reduce: it ships the model, data, loss and optimizer to the worker
engines (pickled by value, so functions defined in a notebook or a local module travel), forms the
group (TF_CONFIG-style spec on ports the engines reserve beside their TF servers), then asks every
engine to run the next calls of ``steps_per_call`` steps together and records what they measured.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ....cluster.health import LOST, RECOVERING
from ....errors import ClusterStateError, ControllerLost, TrainingError
from ....telemetry.events import ALLREDUCE_APPLY
from ...data import DataContext, batch_spec, features_of
from ...fit.evaluation import is_dataset, named_results
from ...job.recovery import TaskLost
from ...job.trainer import HeldByJob
from ...modelling.building import local_model
from . import engine as allreduce_engine
from .group import GROUP_TIMEOUT, WorkerGroup, portable
from .mirror import CallbackMirror

HEALTH_POLL_SECONDS = 0.1  # how often a waiting call looks at the workers' health
LOSS_GRACE = 3.0  # seconds a failed call waits for the health monitor to say whether a worker was lost
# how long one request of calls to the workers may last, at the pace of the calls before: within an epoch, the calls
# that fit go in one request (an engine's turnaround between two requests, 2-3 ms on a busy machine, was a tenth of
# the digits MLP's steps), and the batch hooks and dashboards still hear from the workers this often
REQUEST_SECONDS = 0.2


def global_means(results) -> tuple[list[float], list[list[float]]]:
    """Each step's loss and metrics over the global batch: the mean of the workers' ``run_steps`` results (each
    worker's mean over its equal share of the batch)."""
    import numpy as np

    results = list(results)
    losses = np.mean([r["losses"] for r in results], axis=0)
    metrics = np.mean([np.reshape(r["metrics"], (len(r["losses"]), -1)) for r in results], axis=0)
    return losses.tolist(), metrics.tolist()


def request_calls(first: int, limit: int, per_call: int, call_seconds: float,
                  due: Callable[[int], bool] | None = None) -> list[int]:
    """The calls of steps one request carries from step ``first``: calls of ``per_call`` steps, as many as last
    ``REQUEST_SECONDS`` at ``call_seconds`` a call (one while that is 0, not timed yet: the first call traces), none
    past ``limit`` (the epoch's end), and none after a call at whose end ``due(step)`` says a checkpoint falls due
    (it holds that call's weights)."""
    most = max(1, int(REQUEST_SECONDS / call_seconds)) if call_seconds > 0 else 1
    calls: list[int] = []
    step = first
    while len(calls) < most and step < limit:
        calls.append(min(per_call, limit - step))
        step += calls[-1]
        if due is not None and due(step):
            break
    return calls


@dataclass
class StepsRequest:
    """Calls of steps from ``first``, ``calls[i]`` steps the i-th, sent to every worker engine as one request: what
    they will answer (a result per call), and the request's in-progress spans."""

    first: int
    calls: list[int]
    sent: dict
    spans: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return sum(self.calls)

    @property
    def end(self) -> int:
        return self.first + self.n


class AllReduceTrainer(HeldByJob):
    """The ``Trainer`` of ``wb.AllReduce``: the steps run on the worker engines, which the kernel calls together."""

    holders = "all-reduce worker"
    uses_connection = False

    def __init__(self, job):
        super().__init__(job)
        self.run_id = uuid.uuid4().hex  # what the engines keep for this job is filed under it
        self.restore_tasks: list[str] = []  # none: a lost worker ends the run through its own check (TaskLost for all)
        self.engines: list[int] = []
        self.replicas = self.per_replica_batch = 0
        self.mirror: CallbackMirror | None = None
        self._group: WorkerGroup | None = None
        self._devices: dict[int, str] = {}
        self._payload = None
        self._next_health_check = 0.0
        self._reused = False  # the engines took the step function of an earlier job of the program
        self._call_seconds = 0.0  # how long a call of steps took the workers lately; 0: not timed yet

    def check_rescale(self, workers: int) -> None:
        job = self.job
        raise ClusterStateError(
            f"cannot scale cluster {job.cluster.name!r} while {job.describe()} trains: its all-reduce group "
            "(TensorFlow's collective ops, one fixed group of workers) cannot take or lose members mid-job, and the "
            "workbench forms a new group only from a checkpoint, after a lost worker, not for a scale. Wait for the job "
            "(job.wait()) or stop it, then scale; async-ps and sync-ps jobs follow a scale at their next step.")

    def set_up(self) -> None:
        job, options = self.job, self.options
        inputs = job.inputs
        self._payload = portable((inputs.model, inputs.data, inputs.loss, inputs.optimizer, tuple(options.metrics)))
        latest = self._latest_checkpoint() if options.resume else None
        job.start_step = self._form_and_prepare(latest)
        if options.resume:
            job.last_checkpoint = latest

    def _form_and_prepare(self, checkpoint: str | None) -> int:
        """Form the group on the current worker engines and build the job there, from ``checkpoint`` if given (that
        one, not the directory's newest: a save that failed on a worker may have left a newer one); return the step
        it starts at."""
        job, options = self.job, self.options
        self._group = WorkerGroup(job.cluster)
        stale = self._group.stale()
        if stale:  # re-hosted on new engines, which join the group afresh (about a second each)
            for name in stale:
                job.cluster.replace_task(name, refresh_connection=False)
            self._group = WorkerGroup(job.cluster)
        job.workers, self.engines = self._group.workers, self._group.engines
        program = self._group.form()
        seed = 0 if options.seed is None else options.seed
        # program: the earlier job whose program every worker keeps, which this job may train again (``engine.prepare``);
        # init_seed: an unseeded job's initial values there, the same on every worker
        settings = dict(seed=seed, seeded=options.seed is not None, program=program, init_seed=secrets.randbelow(2**31),
                        num_workers=len(self.engines), per_worker_batch=options.per_worker_batch, checkpoint=checkpoint)
        prepared = self.call_all(
            {e: (allreduce_engine.prepare, self.run_id, self._payload, {**settings, "index": i}) for i, e in enumerate(self.engines)},
            "building the model on the workers", GROUP_TIMEOUT)
        first = prepared[self.engines[0]]
        job.metric_names = first["metric_names"]
        self.replicas, self.per_replica_batch = first["replicas"], first["per_replica_batch"]
        self._reused = all(p["reused_step_function"] for p in prepared.values())
        # where each worker's replica computes: the strategy chose it on the engine (its GPU where it has one)
        self._devices = {r.engine_id: f"{r.task.device}/device:{prepared[r.engine_id]['device']}" for r in job.workers}
        return first["start_step"]

    def restore(self, checkpoint: str | None, step: int) -> None:
        """After its workers were re-hosted: form the group again, and go on from the job's newest checkpoint."""
        restored = self._form_and_prepare(checkpoint)
        if restored != step:
            raise TrainingError(f"the all-reduce workers restored step {restored} from {checkpoint}, but the job "
                                f"saved step {step} there: another run wrote to "
                                f"{self.options.checkpoint.directory!r}; give each job a checkpoint directory of its own.")

    def _latest_checkpoint(self) -> str | None:
        import tensorflow as tf

        return tf.train.latest_checkpoint(self.options.checkpoint.directory)

    def call_all(self, calls: dict[int, tuple], what: str, timeout: float) -> dict[int, Any]:
        """Call the workers together; a worker lost or hung meanwhile ends the call with ``TaskLost``."""
        return self._wait(self._group.send(calls), what, timeout)

    def _wait(self, sent: dict, what: str, timeout: float) -> dict[int, Any]:
        """The workers' answers to ``sent`` (``WorkerGroup.send``); a worker lost or hung meanwhile: ``TaskLost``."""
        try:
            return self._group.wait(sent, what, timeout, check=self._check_workers_now_and_then)
        except TrainingError:
            self._check_workers(grace=LOSS_GRACE)  # a failed call is often the first sign: let health catch up
            raise

    def _check_workers_now_and_then(self) -> None:
        """``_check_workers()``, at most every ``HEALTH_POLL_SECONDS``: the calls are polled every few milliseconds."""
        now = time.monotonic()
        if now >= self._next_health_check:
            self._next_health_check = now + HEALTH_POLL_SECONDS
            self._check_workers()

    def _check_workers(self, grace: float = 0.0) -> None:
        """Raise ``TaskLost`` (every worker) if one is lost, or silent past ``hang_timeout`` with ``on_hang="replace"``.

        Every worker waits for every other in an all-reduce, and TensorFlow cannot take a new member
        into a running group, so the job re-forms the group on new engines from its newest checkpoint.
        """
        job = self.job
        if job.cluster.failure:
            raise ControllerLost(job.cluster.failure)
        names = [r.name for r in job.workers]
        supervisor = job.supervisor
        deadline = time.monotonic() + grace
        while True:
            lost = [n for n in names if supervisor is not None and supervisor.state(n) in (LOST, RECOVERING)]
            hung = supervisor.hung(names) if supervisor is not None else []
            if hung and self.options.recovery.hang_policy != "replace":
                for name in hung:
                    supervisor.fault(name, "silent", f"answered nothing for {self.options.recovery.hang_timeout:.0f} s", "waited")
                hung = []
            if lost or hung or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if not (lost or hung):
            return
        at_fault = lost or hung
        why = "was lost (its engine exited)" if lost else f"answered nothing for {self.options.recovery.hang_timeout:.0f} s"
        error = TrainingError(f"{', '.join(at_fault)} {why}, and an all-reduce needs every worker: the job stopped at step "
                              f"{job.start_step + job.steps_done}. With recovery=wb.Recovery() (the default) the "
                              "workbench forms the group again on new engines and resumes from the newest checkpoint.")
        raise TaskLost(names, f"{why}; every worker is re-hosted (TensorFlow cannot take a new member into a running "
                       "all-reduce group)", error, label=", ".join(at_fault))

    def info(self) -> dict:
        return {"replicas": self.replicas, "per_replica_batch_size": self.per_replica_batch,
                "gradients_per_step": self.replicas, "reused_step_function": self._reused}

    def run(self) -> None:
        """The job's requests of steps. Within an epoch each is sent while the one before runs, so that the engines go
        from one to the next without waiting for the kernel (a round trip of about 3 ms here, against 20-25 ms for ten
        steps of the digits MLP), and a request carries as many of the epoch's calls as fit in ``REQUEST_SECONDS``.
        The batch hooks of the calls that came back run while the next request does, as under async-ps (a hook
        reading ``model`` sees the weights once that request is done too). A request after which a checkpoint is due
        is not followed (the checkpoint holds its weights), and every epoch ends with nothing in flight: its hooks
        see the weights of its last step."""
        job, loop = self.job, self.job.loop
        first = job.start_step + job.steps_done  # after a restore: the steps its checkpoint includes
        request: StepsRequest | None = None  # the request in flight
        while True:
            if request is None:
                loop.tick(parked=True)  # nothing in flight: the epoch's end once its steps are done
                if job.stop_requested or loop.finished:
                    return
                if not loop.claimable(first):
                    raise TrainingError(f"internal: all-reduce step {first} is not released by the epoch loop "
                                        f"(limit {loop.limit}); please report this.")
                request = self._send_steps(first)
                self._draw(request)
            following = self._send_steps(request.end) if self._may_follow(request) else None
            self._record(request)
            if following is not None:
                self._draw(following)  # it runs from now on
            loop.tick(parked=False)  # the calls' batch hooks, while the next request runs
            first, request = request.end, following

    def _may_follow(self, request: StepsRequest) -> bool:
        """Whether the request after ``request`` may be sent before ``request`` answered: it is of the same epoch,
        nothing asked the job to stop, and no checkpoint is due once ``request`` is recorded."""
        job = self.job
        due = job.cadence is not None and job.cadence.due(request.end)
        return not job.stop_requested and job.loop.claimable(request.end) and not due

    def _send_steps(self, first: int) -> StepsRequest:
        """Send the request of calls of steps from ``first`` (``_calls_from``) to every worker."""
        calls = self._calls_from(first)
        return StepsRequest(first, calls, self._group.send({e: (allreduce_engine.run_steps, self.run_id, calls)
                                                            for e in self.engines}))

    def _calls_from(self, first: int) -> list[int]:
        """The calls one request carries from ``first`` (``request_calls``), at the pace of the calls before."""
        job = self.job
        return request_calls(first, job.loop.limit, self.options.strategy.steps_per_call, self._call_seconds,
                             due=job.cadence.due if job.cadence is not None else None)

    def _draw(self, request: StepsRequest) -> None:
        """The request's in-progress spans, on the dashboards until its steps replace them."""
        job = self.job
        request.spans = [job.recorder.call_started(r.name, self._devices[r.engine_id], request.first, request.n)
                         for r in job.workers]

    def _record(self, request: StepsRequest) -> None:
        """Wait for ``request``'s steps on every worker; each call of it into the job's history (its batch hooks, and
        a checkpoint if one is due) and the dashboards."""
        job = self.job
        try:
            results = self._wait(request.sent, f"steps {request.first}-{request.end - 1}",
                                 self.options.recovery.step_timeout * request.n)
        finally:
            for key in request.spans:
                job.recorder.call_ended(key)  # a no-op for the spans the results complete below
        first = request.first
        for i, n in enumerate(request.calls):
            self._record_call(first, n, {engine: answers[i] for engine, answers in results.items()})
            first += n
        self._call_seconds = max(a[-1]["stamps"][-1] - a[0]["stamps"][0] for a in results.values()) / len(request.calls)

    def _record_call(self, first: int, n: int, results: dict[int, dict]) -> None:
        """One call's steps, from every worker's answer (``engine.run_steps``)."""
        job = self.job
        for r in job.workers:
            mine = results[r.engine_id]
            job.recorder.steps(r.name, self._devices[r.engine_id], first, mine["stamps"], mine["marks"],
                               self.options.per_worker_batch, ALLREDUCE_APPLY)
        losses, metrics = global_means(results.values())
        starts = [min(r["stamps"][i] for r in results.values()) for i in range(n)]
        ends = [max(r["stamps"][i + 1] for r in results.values()) for i in range(n)]
        names = ",".join(r.name for r in job.workers)
        job.record_call([job.step_record(first + i, losses[i], metrics[i], names, starts[i], ends[i],
                                         self.options.batch_size, aggregated=len(self.engines))
                         for i in range(n)])  # and a checkpoint, if one is due

    def free_engines(self) -> None:
        try:
            self.job.cluster.client[list(self.engines)].apply_async(allreduce_engine.finish, self.run_id)
        except Exception:  # noqa: BLE001 - an optimisation: a stopped cluster or a lost engine needs none
            pass

    def release(self) -> None:
        """Nothing lives in this kernel: the engines keep the trained weights until the next job (``free_engines``)."""

    def release_remote(self) -> None:
        """The kernel's connection is not used: what lives on the engines stays."""

    def bytes_per_step(self) -> dict | None:
        return None  # no ps: the all-reduce's traffic is TensorFlow's collectives'

    def save(self, step: int) -> str:
        checkpoint = self.options.checkpoint
        saved = self.call_all({e: (allreduce_engine.save, self.run_id, checkpoint.directory, step, checkpoint.keep)
                               for e in self.engines}, "writing a checkpoint", GROUP_TIMEOUT)
        return saved[self.engines[0]]

    def follow_scale(self, leaving: set[str]) -> bool:
        return False  # check_rescale refused it

    def validate(self, data: Any, steps: int | None) -> dict[str, float]:
        """Validation at an epoch's end: a data function on every worker's engine at once (each its share of the
        batches, on its replica of the weights); a dataset here, on the callbacks' copy of the weights."""
        from ...fit.evaluation import combine_parts

        if is_dataset(data):
            mirror = self.callback_model()[1]
            mirror.stale()
            mirror.read()  # the weights of now
            return self.job.validate_dataset(mirror.model, data, steps)
        payload = portable(data)
        parts = self.call_all({e: (allreduce_engine.validate, self.run_id, payload, steps) for e in self.engines},
                              "validating", GROUP_TIMEOUT)
        return combine_parts([(p["values"], p["count"]) for p in parts.values()], self.job.metric_names)

    def callback_model(self):
        """A local copy, compiled like the job: its weights come from worker 0 when a callback reads ``model``."""
        if self.mirror is None:
            self.mirror = CallbackMirror(self)
        return self.mirror.model, self.mirror

    def evaluate(self, data: Callable, batch_size: int) -> dict[str, float]:
        """One pass of ``data(ctx)`` on ``worker:0``'s engine, on the weights it trained (see ``Job.evaluate``)."""
        engine = self.engines[0]
        result = self.call_all({engine: (allreduce_engine.evaluate, self.run_id, portable(data), batch_size)},
                               "evaluating", GROUP_TIMEOUT)[engine]
        return named_results(result["values"], self.job.metric_names, result["count"])

    def model_on_tasks(self):
        return None  # every worker holds a copy

    def local_model(self):
        """A local Keras model (in this kernel, no cluster needed) holding the trained weights."""
        engine = self.engines[0]
        weights = self.call_all({engine: (allreduce_engine.weights, self.run_id)}, "fetching the weights", GROUP_TIMEOUT)[engine]
        return local_model(self.job.inputs.model, *self.example_spec(), weights)

    def example_rank(self) -> int:
        return len(self.example_spec()[0])

    def example_spec(self) -> tuple[list, Any]:
        """One example's features: their shape and dtype (from the data function, here)."""
        return features_of(self.batch_spec())

    def batch_spec(self) -> tuple[Any, Any]:
        """The ``(features, labels)`` specs of the data function's batches (made here)."""
        seed = 0 if self.options.seed is None else self.options.seed
        return batch_spec(self.job.inputs.data, DataContext(0, 1, 1, seed))
