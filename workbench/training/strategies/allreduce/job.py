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
from typing import Any

from ....cluster.health import LOST, RECOVERING
from ....errors import ClusterStateError, ControllerLost, TrainingError
from ....telemetry.events import ALLREDUCE_APPLY
from ...data import DataContext, example_spec
from ...fit.evaluation import is_dataset, named_results
from ...job.job import Job
from ...job.recovery import TaskLost
from ...modelling.building import learning_rate_of, local_model
from ...modelling.losses import resolve_loss
from . import engine as allreduce_engine
from .group import GROUP_TIMEOUT, WorkerGroup, portable

HEALTH_POLL_SECONDS = 0.1  # how often a waiting call looks at the workers' health
LOSS_GRACE = 3.0  # seconds a failed call waits for the health monitor to say whether a worker was lost


class CallbackMirror:
    """The callbacks' model of an all-reduce job: a local copy of the model, compiled like the job.

    Its weights, learning rate and iteration count are fetched from worker 0 the first time a callback
    reads ``callback.model`` in a hook (``read``); what the hook changed there (``set_weights``, as
    ``EarlyStopping(restore_best_weights=True)`` does, or the learning rate) is sent to every worker after it
    (``push_changes``).
    """

    def __init__(self, job: AllReduceJob):
        import tensorflow as tf

        from ...modelling.building import LOCAL_CPU, build_model, build_optimizer

        self._job = weakref.ref(job)  # not a cycle (job._mirror): an ended job nobody holds is freed at once
        with tf.device(LOCAL_CPU):
            self.model = build_model(job._model_source, tf.zeros(*job._example_spec()))
            self.model.compile(optimizer=build_optimizer(job._optimizer_source), loss=job._loss_source,
                               metrics=list(job.options.metrics))
        self.model.optimizer.build(self.model.trainable_variables)
        self._fetched: dict | None = None  # what the workers had at this hook's first read; None: not read yet

    def stale(self) -> None:
        self._fetched = None

    def read(self) -> None:
        if self._fetched is not None:
            return
        job = self._job()
        engine = job._engines[0]
        state = job._call_all({engine: (allreduce_engine.state, job._run_id)}, "fetching the weights", GROUP_TIMEOUT)[engine]
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
            job = self._job()
            job._call_all({e: (allreduce_engine.assign, job._run_id, weights if changed else None, new_rate)
                           for e in job._engines}, "setting the weights a callback changed", GROUP_TIMEOUT)
            self._fetched = {**self._fetched, "weights": weights, "learning_rate": rate}


class AllReduceJob(Job):
    """A ``wb.train(..., strategy="allreduce")`` job; same interface as the ps jobs."""

    _uses_connection = False

    def check_rescale(self, workers: int) -> None:
        raise ClusterStateError(
            f"cannot scale cluster {self.cluster.name!r} while {self.describe()} trains: its all-reduce group "
            "(TensorFlow's collective ops, one fixed group of workers) cannot take or lose members mid-job, and the "
            "workbench forms a new group only from a checkpoint, after a lost worker, not for a scale. Wait for the job "
            "(job.wait()) or stop it, then scale; async-ps and sync-ps jobs follow a scale at their next step.")

    def _setup(self, cluster, model: Any, data: Callable, loss: Any, optimizer: Any, options) -> None:
        self._epoch = None
        self._ps_names: list[str] = []
        self._run_id = uuid.uuid4().hex
        self._next_health_check = 0.0
        self._payload = portable((model, data, loss, optimizer, tuple(options.metrics)))
        self._loss_fn = resolve_loss(loss)
        self.start_step = self._form_and_prepare(resume=options.resume)
        if options.resume:
            self.last_checkpoint = self._latest_checkpoint()

    def _form_and_prepare(self, resume: bool) -> int:
        """Form the group on the current worker engines and build the job there; return the step it starts at."""
        options = self.options
        self._group = WorkerGroup(self.cluster)
        stale = self._group.stale()
        if stale:  # re-hosted on new engines, which join the group afresh (about a second each)
            for name in stale:
                self.cluster.replace_task(name, refresh_connection=False)
            self._group = WorkerGroup(self.cluster)
        self._workers, self._engines = self._group.workers, self._group.engines
        self._group.form()
        seed = 0 if options.seed is None else options.seed
        settings = dict(seed=seed, seeded=options.seed is not None, num_workers=len(self._engines),
                        per_worker_batch=options.per_worker_batch, resume=resume,
                        checkpoint_dir=options.checkpoint.directory if options.checkpoint else None)
        prepared = self._call_all(
            {e: (allreduce_engine.prepare, self._run_id, self._payload, {**settings, "index": i}) for i, e in enumerate(self._engines)},
            "building the model on the workers", GROUP_TIMEOUT)
        first = prepared[self._engines[0]]
        self.metric_names = first["metric_names"]
        self.replicas, self.per_replica_batch = first["replicas"], first["per_replica_batch"]
        # where each worker's replica computes: the strategy chose it on the engine (its GPU where it has one)
        self._devices = {r.engine_id: f"{r.task.device}/device:{prepared[r.engine_id]['device']}" for r in self._workers}
        return first["start_step"]

    def _restore_state(self) -> int:
        """After its workers were re-hosted: form the group again, and go on from the job's newest checkpoint."""
        kept = self._saved_records.get(self.last_checkpoint, 0)  # 0 for the checkpoint the job resumed from
        step = self._form_and_prepare(resume=self.last_checkpoint is not None)
        if step != self.start_step + kept:
            raise TrainingError(f"the all-reduce workers restored step {step} from {self.last_checkpoint}, but the job "
                                f"saved step {self.start_step + kept} there: another run wrote to "
                                f"{self.options.checkpoint.directory!r}; give each job a checkpoint directory of its own.")
        return kept

    def _latest_checkpoint(self) -> str | None:
        import tensorflow as tf

        return tf.train.latest_checkpoint(self.options.checkpoint.directory)

    def _call_all(self, calls: dict[int, tuple], what: str, timeout: float) -> dict[int, Any]:
        """Call the workers together; a worker lost or hung meanwhile ends the call with ``TaskLost``."""
        try:
            return self._group.call_all(calls, what, timeout, check=self._check_workers_now_and_then)
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
        if self.cluster.failure:
            raise ControllerLost(self.cluster.failure)
        names = [r.name for r in self._workers]
        deadline = time.monotonic() + grace
        while True:
            lost = [n for n in names if self._supervisor is not None and self._supervisor.state(n) in (LOST, RECOVERING)]
            hung = self._supervisor.hung(names) if self._supervisor is not None else []
            if hung and self.options.recovery.hang_policy != "replace":
                for name in hung:
                    self._supervisor.fault(name, "silent", f"answered nothing for {self.options.recovery.hang_timeout:.0f} s", "waited")
                hung = []
            if lost or hung or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if not (lost or hung):
            return
        at_fault = lost or hung
        why = "was lost (its engine exited)" if lost else f"answered nothing for {self.options.recovery.hang_timeout:.0f} s"
        error = TrainingError(f"{', '.join(at_fault)} {why}, and an all-reduce needs every worker: the job stopped at step "
                              f"{self.start_step + self.steps_done}. With recovery=wb.Recovery() (the default) the "
                              "workbench forms the group again on new engines and resumes from the newest checkpoint.")
        raise TaskLost(names, f"{why}; every worker is re-hosted (TensorFlow cannot take a new member into a running "
                       "all-reduce group)", error, label=", ".join(at_fault))

    @property
    def info(self) -> dict:
        info = super().info
        info.update(replicas=self.replicas, per_replica_batch_size=self.per_replica_batch, gradients_per_step=self.replicas)
        return info

    def _run(self) -> None:
        chunk = self.options.strategy.steps_per_call
        names = ",".join(r.name for r in self._workers)
        done = self.steps_done  # after a restore: the steps its checkpoint includes
        while not self._stop.is_set():
            self._loop.tick(parked=True)  # between calls: the callbacks, and the epoch's end once its steps are done
            first = self.start_step + done
            if self._loop.finished:
                return
            if not self._loop.claimable(first):
                raise TrainingError(f"internal: all-reduce step {first} is not released by the epoch loop "
                                    f"(limit {self._loop.limit}); please report this.")
            n = min(chunk, self._loop.limit - first)
            keys = {r.engine_id: self._recorder.call_started(r.name, self._devices[r.engine_id], first, n) for r in self._workers}
            try:
                results = self._call_all({e: (allreduce_engine.run_steps, self._run_id, n) for e in self._engines},
                                         f"steps {first}-{first + n - 1}", self.options.recovery.step_timeout * n)
            finally:
                for key in keys.values():
                    self._recorder.call_ended(key)  # a no-op for the spans the results complete below
            for r in self._workers:
                mine = results[r.engine_id]
                self._recorder.steps(r.name, self._devices[r.engine_id], first, mine["stamps"], mine["marks"],
                                     self.options.per_worker_batch, ALLREDUCE_APPLY)
            ours = results[self._engines[0]]  # loss and metrics are already averaged over the workers
            starts = [min(r["stamps"][i] for r in results.values()) for i in range(n)]
            ends = [max(r["stamps"][i + 1] for r in results.values()) for i in range(n)]
            self.record_call([self.step_record(self.start_step + done + i, ours["losses"][i], ours["metrics"][i], names,
                                                starts[i], ends[i], self.options.batch_size, aggregated=len(self._engines))
                              for i in range(n)])  # and a checkpoint, if one is due
            done += n

    def _trim_engines(self) -> None:
        try:
            self.cluster.client[list(self._engines)].apply_async(allreduce_engine.finish, self._run_id)
        except Exception:  # noqa: BLE001 - an optimisation: a stopped cluster or a lost engine needs none
            pass

    def _save(self) -> None:
        done = self.steps_done
        step = self.start_step + done
        checkpoint = self.options.checkpoint
        saved = self._call_all({e: (allreduce_engine.save, self._run_id, checkpoint.directory, step, checkpoint.keep)
                                for e in self._engines}, "writing a checkpoint", GROUP_TIMEOUT)
        self.last_checkpoint = saved[self._engines[0]]
        self._saved_records[self.last_checkpoint] = done

    def _validate(self, data: Any, steps: int | None) -> dict[str, float]:
        """Validation at an epoch's end: a data function on every worker's engine at once (each its share of the
        batches, on its replica of the weights); a dataset here, on the callbacks' copy of the weights."""
        from ...fit.evaluation import combine_parts

        if is_dataset(data):
            mirror = self._callback_model()[1]
            mirror.stale()
            mirror.read()  # the weights of now
            return self._evaluate_on(mirror.model, data, steps)
        payload = portable(data)
        parts = self._call_all({e: (allreduce_engine.validate, self._run_id, payload, steps) for e in self._engines},
                               "validating", GROUP_TIMEOUT)
        return combine_parts([(p["values"], p["count"]) for p in parts.values()], self.metric_names)

    def _callback_model(self):
        """A local copy, compiled like the job: its weights come from worker 0 when a callback reads ``model``."""
        if getattr(self, "_mirror", None) is None:
            self._mirror = CallbackMirror(self)
        return self._mirror.model, self._mirror

    def _evaluate_data_function(self, data: Callable, batch_size: int) -> dict[str, float]:
        """One pass of ``data(ctx)`` on ``worker:0``'s engine, on the weights it trained (see ``Job.evaluate``)."""
        engine = self._engines[0]
        result = self._call_all({engine: (allreduce_engine.evaluate, self._run_id, portable(data), batch_size)},
                                "evaluating", GROUP_TIMEOUT)[engine]
        return named_results(result["values"], self.metric_names, result["count"])

    @property
    def model(self):
        """A local Keras model (in this kernel, no cluster needed) holding the trained weights."""
        engine = self._engines[0]
        weights = self._call_all({engine: (allreduce_engine.weights, self._run_id)}, "fetching the weights", GROUP_TIMEOUT)[engine]
        return local_model(self._model_source, *self._example_spec(), weights)

    def _example_rank(self) -> int:
        return len(self._example_spec()[0])

    def _example_spec(self) -> tuple[list, Any]:
        seed = 0 if self.options.seed is None else self.options.seed
        return example_spec(self._data, DataContext(0, 1, 1, seed))
