"""``strategy="allreduce"``: synchronous data parallelism with MultiWorkerMirroredStrategy on the engines.

The kernel does not join the all-reduce: it ships the model, data, loss and optimizer to the worker
engines (pickled by value, so functions defined in a notebook or a local module travel), forms the
group (TF_CONFIG-style spec on ports the engines reserve beside their TF servers), then asks every
engine to run the next ``steps_per_call`` steps together and records what they measured.
"""

from __future__ import annotations

import time
import uuid
import weakref
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
from ...modelling.building import learning_rate_of, local_model
from . import engine as allreduce_engine
from .group import GROUP_TIMEOUT, WorkerGroup, portable

HEALTH_POLL_SECONDS = 0.1  # how often a waiting call looks at the workers' health
LOSS_GRACE = 3.0  # seconds a failed call waits for the health monitor to say whether a worker was lost


def global_means(results) -> tuple[list[float], list[list[float]]]:
    """Each step's loss and metrics over the global batch: the mean of the workers' ``run_steps`` results (each
    worker's mean over its equal share of the batch)."""
    import numpy as np

    results = list(results)
    losses = np.mean([r["losses"] for r in results], axis=0)
    metrics = np.mean([np.reshape(r["metrics"], (len(r["losses"]), -1)) for r in results], axis=0)
    return losses.tolist(), metrics.tolist()


class CallbackMirror:
    """The callbacks' model of an all-reduce job: a local copy of the model, compiled like the job.

    Its weights, learning rate and iteration count are fetched from worker 0 the first time a callback
    reads ``callback.model`` in a hook (``read``); what the hook changed there (``set_weights``, as
    ``EarlyStopping(restore_best_weights=True)`` does, or the learning rate) is sent to every worker after it
    (``push_changes``).
    """

    def __init__(self, trainer: AllReduceTrainer):
        import tensorflow as tf

        from ...modelling.building import LOCAL_CPU, build_model, build_optimizer, compile_like_the_job

        self._trainer = weakref.ref(trainer)  # not a cycle (trainer.mirror): an ended job nobody holds is freed at once
        inputs = trainer.job.inputs
        batch = trainer.batch_spec()
        with tf.device(LOCAL_CPU):
            self.model = build_model(inputs.model, tf.zeros(*features_of(batch)))
            compile_like_the_job(self.model, build_optimizer(inputs.optimizer), inputs.loss, trainer.options.metrics, batch)
        self.model.optimizer.build(self.model.trainable_variables)
        self._fetched: dict | None = None  # what the workers had at this hook's first read; None: not read yet

    def stale(self) -> None:
        self._fetched = None

    def read(self) -> None:
        if self._fetched is not None:
            return
        trainer = self._trainer()
        engine = trainer.engines[0]
        state = trainer.call_all({engine: (allreduce_engine.state, trainer.run_id)}, "fetching the weights",
                                 GROUP_TIMEOUT)[engine]
        self.model.set_weights(state["weights"])
        optimizer = self.model.optimizer
        if state["learning_rate"] is not None:
            optimizer.learning_rate = state["learning_rate"]
        optimizer.iterations.assign(state["iterations"])
        self._fetched = state

    def push_changes(self) -> None:
        """Send what a hook changed in the copy (weights, learning rate) to every worker."""
        import numpy as np

        if self._fetched is None:
            return
        weights = self.model.get_weights()
        changed = any(not np.array_equal(a, b) for a, b in zip(weights, self._fetched["weights"]))
        rate = learning_rate_of(self.model.optimizer) if self._fetched["learning_rate"] is not None else None
        new_rate = rate if rate is not None and rate != self._fetched["learning_rate"] else None
        if changed or new_rate is not None:
            trainer = self._trainer()
            trainer.call_all({e: (allreduce_engine.assign, trainer.run_id, weights if changed else None, new_rate)
                              for e in trainer.engines}, "setting the weights a callback changed", GROUP_TIMEOUT)
            self._fetched = {**self._fetched, "weights": weights, "learning_rate": rate}


@dataclass
class StepsCall:
    """``n`` steps from ``first``, sent to every worker engine: what they will answer, and the call's in-progress spans."""

    first: int
    n: int
    sent: dict
    spans: list[str] = field(default_factory=list)

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
        job.start_step = self._form_and_prepare(resume=options.resume)
        if options.resume:
            job.last_checkpoint = self._latest_checkpoint()

    def _form_and_prepare(self, resume: bool) -> int:
        """Form the group on the current worker engines and build the job there; return the step it starts at."""
        job, options = self.job, self.options
        self._group = WorkerGroup(job.cluster)
        stale = self._group.stale()
        if stale:  # re-hosted on new engines, which join the group afresh (about a second each)
            for name in stale:
                job.cluster.replace_task(name, refresh_connection=False)
            self._group = WorkerGroup(job.cluster)
        job.workers, self.engines = self._group.workers, self._group.engines
        self._group.form()
        seed = 0 if options.seed is None else options.seed
        settings = dict(seed=seed, seeded=options.seed is not None, num_workers=len(self.engines),
                        per_worker_batch=options.per_worker_batch, resume=resume,
                        checkpoint_dir=options.checkpoint.directory if options.checkpoint else None)
        prepared = self.call_all(
            {e: (allreduce_engine.prepare, self.run_id, self._payload, {**settings, "index": i}) for i, e in enumerate(self.engines)},
            "building the model on the workers", GROUP_TIMEOUT)
        first = prepared[self.engines[0]]
        job.metric_names = first["metric_names"]
        self.replicas, self.per_replica_batch = first["replicas"], first["per_replica_batch"]
        # where each worker's replica computes: the strategy chose it on the engine (its GPU where it has one)
        self._devices = {r.engine_id: f"{r.task.device}/device:{prepared[r.engine_id]['device']}" for r in job.workers}
        return first["start_step"]

    def restore(self, checkpoint: str | None, step: int) -> None:
        """After its workers were re-hosted: form the group again, and go on from the job's newest checkpoint."""
        restored = self._form_and_prepare(resume=checkpoint is not None)
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
                "gradients_per_step": self.replicas}

    def run(self) -> None:
        """The job's calls of steps. Within an epoch each is sent while the one before runs, so that the engines go
        from one to the next without waiting for the kernel (a round trip of about 3 ms here, against 20-25 ms for ten
        steps of the digits MLP); the batch hooks of a call that came back run while the next one does, as under
        async-ps (a hook reading ``model`` sees the weights once that call is done too). A call after which a
        checkpoint is due is not followed (the checkpoint holds its weights), and every epoch ends with nothing in
        flight: its hooks see the weights of its last step."""
        job, loop = self.job, self.job.loop
        first = job.start_step + job.steps_done  # after a restore: the steps its checkpoint includes
        call: StepsCall | None = None  # the call in flight
        while True:
            if call is None:
                loop.tick(parked=True)  # nothing in flight: the epoch's end once its steps are done
                if job.stop_requested or loop.finished:
                    return
                if not loop.claimable(first):
                    raise TrainingError(f"internal: all-reduce step {first} is not released by the epoch loop "
                                        f"(limit {loop.limit}); please report this.")
                call = self._send_steps(first)
                self._draw(call)
            following = self._send_steps(call.end) if self._may_follow(call) else None
            self._record(call)
            if following is not None:
                self._draw(following)  # it runs from now on
            loop.tick(parked=False)  # the call's batch hooks, while the next one runs
            first, call = call.end, following

    def _may_follow(self, call: StepsCall) -> bool:
        """Whether the call after ``call`` may be sent before ``call`` answered: it is of the same epoch, nothing
        asked the job to stop, and no checkpoint is due once ``call`` is recorded."""
        job = self.job
        due = job.cadence is not None and job.cadence.due(call.end)
        return not job.stop_requested and job.loop.claimable(call.end) and not due

    def _send_steps(self, first: int) -> StepsCall:
        """Send the call of steps from ``first`` (to the epoch's end at most) to every worker."""
        n = min(self.options.strategy.steps_per_call, self.job.loop.limit - first)
        return StepsCall(first, n, self._group.send({e: (allreduce_engine.run_steps, self.run_id, n) for e in self.engines}))

    def _draw(self, call: StepsCall) -> None:
        """The call's in-progress spans, on the dashboards until its steps replace them."""
        job = self.job
        call.spans = [job.recorder.call_started(r.name, self._devices[r.engine_id], call.first, call.n) for r in job.workers]

    def _record(self, call: StepsCall) -> None:
        """Wait for ``call``'s steps on every worker; into the job's history (and a checkpoint, if one is due) and the
        dashboards."""
        job = self.job
        try:
            results = self._wait(call.sent, f"steps {call.first}-{call.end - 1}", self.options.recovery.step_timeout * call.n)
        finally:
            for key in call.spans:
                job.recorder.call_ended(key)  # a no-op for the spans the results complete below
        for r in job.workers:
            mine = results[r.engine_id]
            job.recorder.steps(r.name, self._devices[r.engine_id], call.first, mine["stamps"], mine["marks"],
                               self.options.per_worker_batch, ALLREDUCE_APPLY)
        losses, metrics = global_means(results.values())
        starts = [min(r["stamps"][i] for r in results.values()) for i in range(call.n)]
        ends = [max(r["stamps"][i + 1] for r in results.values()) for i in range(call.n)]
        names = ",".join(r.name for r in job.workers)
        job.record_call([job.step_record(call.first + i, losses[i], metrics[i], names, starts[i], ends[i],
                                         self.options.batch_size, aggregated=len(self.engines))
                         for i in range(call.n)])  # and a checkpoint, if one is due

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
