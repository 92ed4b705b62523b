"""``strategy="allreduce"``: synchronous data parallelism with MultiWorkerMirroredStrategy on the engines.

The kernel does not join the all-reduce: it ships the model, data, loss and optimizer to the worker
engines (pickled by value, so functions defined in a notebook or a local module travel), forms the
group (TF_CONFIG-style spec on ports the engines reserve beside their TF servers), then asks every
engine to run the next ``steps_per_call`` steps together and records what they measured.
"""

from __future__ import annotations

import sys
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cluster.health import LOST, RECOVERING
from ..cluster.launch import engine_side
from ..cluster.launch.calls import Deadline, RemoteCallFailed, RemoteCallsTimedOut, run_on_engines
from ..errors import ClusterStateError, ConfigurationError, ControllerLost, TrainingError
from ..telemetry.events import ALLREDUCE_APPLY
from . import allreduce_engine
from .building import learning_rate_of
from .evaluation import is_dataset
from .job import Job
from .recovery import TaskLost
from .steps import resolve_loss

GROUP_TIMEOUT = 120.0  # forming the group and building the model on every worker
HEALTH_POLL_SECONDS = 0.1  # how often a waiting call looks at the workers' health
LOSS_GRACE = 3.0  # seconds a failed call waits for the health monitor to say whether a worker was lost


def _is_installed(module_name: str) -> bool:
    """True for modules an engine can import by name (the standard library, site-packages)."""
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if module is None or path is None:
        return module_name in sys.builtin_module_names
    resolved = str(Path(path).resolve())
    return "site-packages" in resolved or "dist-packages" in resolved or resolved.startswith(str(Path(sys.base_prefix).resolve()))


def portable(value: Any) -> bytes:
    """Pickle ``value`` for the engines; code from modules they may not have travels by value."""
    import cloudpickle
    import keras

    def keras_portable(item):
        if isinstance(item, keras.optimizers.Optimizer):
            return keras.optimizers.deserialize, keras.optimizers.serialize(item)
        if isinstance(item, keras.losses.Loss):
            return keras.losses.deserialize, keras.losses.serialize(item)
        if isinstance(item, keras.Model):
            try:
                return keras.models.model_from_json, item.to_json()
            except Exception:  # noqa: BLE001 - subclassed models have no config
                raise ConfigurationError(
                    f"cannot send {type(item).__name__} to the engines: pass a function that builds the model instead, "
                    "e.g. model=make_model.") from None
        return None

    items = value if isinstance(value, tuple) else (value,)
    shipped = tuple(("rebuild", *keras_portable(i)) if keras_portable(i) else ("as-is", i) for i in items)
    modules = {getattr(i, "__module__", None) for i in items if callable(i)} - {None, "__main__"}
    by_value = [sys.modules[m] for m in modules if m in sys.modules and not _is_installed(m) and not m.startswith("workbench")]
    for module in by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(shipped)
    finally:
        for module in by_value:
            cloudpickle.unregister_pickle_by_value(module)


class WorkerGroup:
    """A cluster's worker engines, called together, with the all-reduce group formed on them."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.client = cluster.client
        self.workers = [r for r in cluster.tasks if r.job == "worker"]
        self.engines = [r.engine_id for r in self.workers]

    def name(self, engine_id: int) -> str:
        return next(r.name for r in self.workers if r.engine_id == engine_id)

    def call_all(self, calls: dict[int, tuple], what: str, timeout: float, check=None) -> dict[int, Any]:
        """Run ``{engine: (function, *args)}`` on the worker engines at once; results by engine.

        ``check()`` runs while waiting, and may raise to stop waiting (the calls are then left to fail).
        """
        try:
            return run_on_engines(self.client, calls, Deadline(timeout), poll=0.005,
                                  on_progress=(lambda _done, _total: check()) if check else None)
        except RemoteCallFailed as exc:
            raise TrainingError(f"{self.name(exc.engine)} failed while {what}: {exc.reason}") from None
        except RemoteCallsTimedOut as exc:
            raise TrainingError(
                f"{', '.join(self.name(e) for e in exc.pending)} did not finish {what} within {timeout:.0f} s (a worker is "
                "stalled or gone, and the others wait for it in the all-reduce). Check cluster.status(); restart the "
                "cluster and resume from the last checkpoint.") from None

    def _reserve_addresses(self, attempts: int = 5) -> list[str]:
        """A free port on each worker's host, distinct per host: engines that reserve at the same moment on one
        host can be handed the same ephemeral port (both then bind it, and one server fails to start)."""
        for _ in range(attempts):
            ports = self.call_all({e: (engine_side.reserve_port,) for e in self.engines}, "reserving all-reduce ports", 30)
            addresses = [f"{r.address.rpartition(':')[0]}:{ports[r.engine_id]}" for r in self.workers]
            if len(set(addresses)) == len(addresses):
                return addresses
        raise ClusterStateError(f"the workers were handed the same port {attempts} times in a row ({', '.join(addresses)}): "
                                "the host is short of free ports. Free some (stop other clusters), then train again.")

    @property
    def key(self) -> list[str]:
        """The group is these TF tasks in these processes, whatever ports it uses."""
        return [f"{r.address} pid {r.pid}" for r in self.workers]

    def stale(self) -> list[str]:
        """Workers whose engine joined a group with other members (one was re-hosted, or the workers were scaled)
        since: TensorFlow cannot change a process's group, and a new member waits forever for them."""
        keys = self.call_all({e: (allreduce_engine.group_key,) for e in self.engines}, "reading the all-reduce groups", 30)
        return [self.name(e) for e, key in keys.items() if key is not None and key != self.key]

    def form(self) -> None:
        """Join every worker engine to one MultiWorkerMirroredStrategy (reused if already formed)."""
        addresses = self._reserve_addresses()
        key = self.key
        joined = self.call_all({e: (allreduce_engine.join_group, addresses, i, key) for i, e in enumerate(self.engines)},
                               "forming the all-reduce group", GROUP_TIMEOUT)
        refused = [(self.name(e), r["error"]) for e, r in joined.items() if not r["ok"]]
        if refused:
            raise ClusterStateError(
                f"{', '.join(n for n, _ in refused)} cannot join an all-reduce group over "
                f"{', '.join(r.name for r in self.workers)}: {refused[0][1]}. The worker set changed since the cluster's "
                "first all-reduce; restart the cluster (cluster.stop(); cluster.start()) to all-reduce over the current workers.")


class CallbackMirror:
    """The callbacks' model of an all-reduce job: a local copy of the model, compiled like the job.

    Its weights, learning rate and iteration count are fetched from worker 0 the first time a callback
    reads ``callback.model`` in a hook (``read``); what the hook changed there (``set_weights``, as
    ``EarlyStopping(restore_best_weights=True)`` does, or the learning rate) is sent to every worker after it
    (``push_changes``).
    """

    def __init__(self, job: AllReduceJob):
        import tensorflow as tf

        from .building import build_model, build_optimizer

        self._job = weakref.ref(job)  # not a cycle (job._mirror): an ended job nobody holds is freed at once
        with tf.device("/job:localhost/replica:0/task:0/device:CPU:0"):
            self.model = build_model(job._model_source, job._example())
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
        next_checkpoint = self.first_checkpoint_at()
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
            for i in range(n):
                self._record(self.start_step + done + i, ours["losses"][i], ours["metrics"][i], names, starts[i], ends[i],
                             self.options.batch_size, last_of_call=i == n - 1, aggregated=len(self._engines))
            done += n
            next_checkpoint = self.checkpoint_due(next_checkpoint)

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
        from .evaluation import combine_parts

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
        values = result["values"]
        return {"loss": values[0], **dict(zip(self.metric_names, values[1:])), "examples": result["count"]}

    @property
    def model(self):
        """A local Keras model (in this kernel, no cluster needed) holding the trained weights."""
        import tensorflow as tf

        from .building import build_model

        engine = self._engines[0]
        weights = self._call_all({engine: (allreduce_engine.weights, self._run_id)}, "fetching the weights", GROUP_TIMEOUT)[engine]
        with tf.device("/job:localhost/replica:0/task:0/device:CPU:0"):
            local = build_model(self._model_source, self._example())
        local.set_weights(weights)
        return local

    def _example_rank(self) -> int:
        return self._example().shape.rank

    def _example(self):
        import tensorflow as tf

        from .data import DataContext, training_dataset

        seed = 0 if self.options.seed is None else self.options.seed
        spec = training_dataset(self._data, DataContext(0, 1, 1, seed)).element_spec[0]
        return tf.zeros([1, *spec.shape[1:]], spec.dtype)


INTERRUPT_GRACE = 30.0  # seconds the workers get to stop an interrupted SPMD cell
OUTPUT_GRACE = 10.0  # seconds a finished cell's printed output may trail its reply (it comes on another channel)


def _wait_for(results: dict, deadline: Deadline) -> bool:
    """Wait until every result is in, or the deadline; in short naps, so that Ctrl-C lands promptly."""
    while not all(r.ready() for r in results.values()):
        if deadline.expired:
            return False
        time.sleep(0.05)
    return True


@dataclass
class WorkerOutput:
    """What one worker printed while running an SPMD cell, and its error (the remote traceback), if any."""

    task: str
    stdout: str
    stderr: str
    error: str | None = None


def run_spmd(cluster, source: str, timeout: float = 600.0) -> list[WorkerOutput]:
    """Run ``source`` on every worker engine at once (SPMD), with the all-reduce group formed.

    The code sees ``strategy`` (a MultiWorkerMirroredStrategy over all workers), ``worker_index``
    and ``num_workers``; ``TF_CONFIG`` is set. Each engine keeps its own namespace between calls.
    Returns each worker's output, in worker order.
    """
    import ipyparallel

    group = WorkerGroup(cluster)
    group.form()
    setup = ("from workbench.training.allreduce_engine import spmd_names as _wb_spmd_names\n"
             "globals().update(_wb_spmd_names())\ndel _wb_spmd_names")
    group.client[group.engines].execute(setup, block=True)
    running = {e: group.client[e].execute(source, block=False) for e in group.engines}
    try:
        finished = _wait_for(running, Deadline(timeout))
    except KeyboardInterrupt:
        # Ctrl-C in the notebook: interrupt the cell on every worker too, and leave the engines usable.
        group.client.send_signal("SIGINT", targets=group.engines, block=True)
        _wait_for(running, Deadline(INTERRUPT_GRACE))
        unfinished = [group.name(e) for e, r in running.items() if not r.ready()]
        raise TrainingError(
            "the SPMD cell was interrupted on every worker"
            + (f"; {', '.join(unfinished)} did not stop within {INTERRUPT_GRACE:.0f} s (a C++ op, e.g. a collective, "
               "cannot be interrupted: restart the cluster if it stays busy)" if unfinished else "; the cluster is ready for the next cell")
            + ".") from None
    if not finished:
        late = [group.name(e) for e, r in running.items() if not r.ready()]
        raise TrainingError(
            f"the SPMD cell did not finish on {', '.join(late)} within {timeout:.0f} s; it may still run there (an "
            "all-reduce waits for every worker). Interrupt the kernel to stop it, or restart the cluster.")
    outputs = []
    trailing = Deadline(OUTPUT_GRACE)
    for engine, result in running.items():
        result.wait_for_output(trailing.remaining(0.01))  # complete stdout/stderr, or what arrived by then
        error = None
        try:
            result.get(timeout=0)
        except ipyparallel.error.RemoteError as exc:  # the user's exception, with the remote traceback
            error = exc.traceback or f"{exc.ename}: {exc.evalue}"
        outputs.append(WorkerOutput(group.name(engine), result.stdout or "", result.stderr or "", error))
    return outputs
