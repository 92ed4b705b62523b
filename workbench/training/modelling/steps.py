"""The TensorFlow functions a training job runs on the cluster's tasks.

* ``train_steps_on(device)(iterator, n)`` (async-ps) runs ``n`` optimizer steps inside one remote call on a
  worker: parameters are read from the ps tasks and updates written back at every step. One function,
  traced once, serves every worker: what is a worker's own (its error-feedback and prefetched
  variables) is passed in as arguments, not captured.
* sync-ps runs its steps through a barrier on the first ps, with its own functions
  (``strategies/sync_ps/steps.py``: ``SyncBarrier``), built on ``loss_and_grads`` and the optimizer here.
* ``evaluate()`` makes one pass over the evaluation data on a worker.

Every function returns ``tf.timestamp()`` readings of its steps, taken where the step runs
(a worker, or the first ps for sync-ps's apply): the job's history and the dashboards' step
spans come from them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...compat.tensorflow import quiet_retracing_of
from .placement import shards_of, tf_variable
from .reuse import CACHE, call, captured_resources, job_variables, program_key


def host_scalar(value, dtype) -> Any:
    """A scalar tensor made in this process, whatever the device scope around the call.

    Made under a remote task's scope (``tf.device("/job:worker/...")``), ``tf.constant`` copies the value to
    that task at once, in a blocking call made holding the GIL: a stopped (hung) task froze the whole kernel,
    its watchdogs and signal handlers too. Made here, it goes to the task with the call that uses it, which
    waits without the GIL.
    """
    import tensorflow as tf

    with tf.device(None):  # no scope: this process's CPU
        return tf.constant(value, dtype)


def _written(variables):
    """A scalar that exists only once every variable's last write landed: depend on it, or wait on it.

    Reads of a variable come after its writes in a ``tf.function`` (automatic control
    dependencies), so this waits for every shard's read, each where the shard lives. Not
    ``tf.size(read)``: with a static shape, ``tf.size`` becomes a constant when the graph is
    built and depends on nothing, so ops "after" it would not wait for the writes at all.
    """
    import tensorflow as tf

    reads = []
    for shard in (s for v in variables for s in shards_of(v)):
        with tf.device(shard.device):
            reads.append(shard.read_value())
    with tf.control_dependencies(reads):
        return tf.constant(0)


def stamp_after(tensors) -> Any:
    """``tf.timestamp()`` taken once every tensor in ``tensors`` exists: when that work was done."""
    import tensorflow as tf

    with tf.control_dependencies([t for t in tensors if t is not None]):
        return tf.timestamp()


# TensorFlow's step functions the workbench makes anew on purpose (one per job; each traced once): no retracing
# warning for them (``compat.tensorflow.quiet_retracing_of``)
OWN_STEP_FUNCTIONS = ("steps_in_one_call.<locals>.make.<locals>.train_steps",
                      "StepFunctions.evaluation_function.<locals>.evaluate")
# Steps laid out one after the other in each pass of a call's loop (see ``steps_in_one_call``)
UNROLL = 2


def steps_in_one_call(one_step: Callable, n_metrics: int, settled: Callable | None = None):
    """A ``tf.function`` ``(iterator, n, state, variables) -> (losses, metrics, stamps, marks)`` running ``n`` steps
    in one call.

    ``one_step(x, y, state) -> (loss, metrics vector, ops to wait for, mark, began)``, where ``state`` is
    the calling worker's own variables (passed through, so that one trace serves every worker) and ``mark`` is
    the ``stamp_after`` of the step's gradients. ``variables`` is every variable of the job the steps reach
    (``reuse.job_variables``; async-ps) or ``()`` (all-reduce: the strategy's mirrored variables stay captured):
    passed as an argument, each one the traced code reaches is that argument, so that the function captures none
    and serves any job of the same program (``reuse.py``). ``stamps`` has n + 1 worker-side times: step i ran from
    ``stamps[i]`` to ``stamps[i + 1]`` and had its gradients at ``marks[i]``.

    Without ``settled``, a step ends once its ops to wait for exist, and the next starts then.
    With it, a step starts at its ``began`` (when its parameters arrived) and ends when the next
    one's arrived: they leave the ps only after this step's update, so no signal has to come
    back from the ps per step to say so. The last step ends at ``settled()``, a tensor that
    exists once every update landed.

    Each pass of the call's loop makes ``UNROLL`` steps, laid out one after the other in the
    graph (a call of ``n`` steps that ``UNROLL`` does not divide takes a second function, one step
    a pass, traced on first use). A loop spanning the worker and the ps costs transfers of its own
    at every pass (its condition to the ps, the start of its body there, the end of the ps's part
    back: three of an async-ps step's five, in the partitioned graphs), so two steps a pass leave
    a step 3.5 instead of 5 (``bench/training.py``: async-ps 1.18 -> 1.29-1.35x PSS). Each step
    laid out is one more trace of it at the start (about 0.25 s here): ten a pass measured 1.68x
    PSS in the steady state but started 2.4 s later.
    """
    import tensorflow as tf

    quiet_retracing_of(*OWN_STEP_FUNCTIONS)

    def make(unroll: int):
        @tf.function
        def train_steps(iterator, n, state, variables):
            losses = tf.TensorArray(tf.float32, size=n)
            metric_values = tf.TensorArray(tf.float32, size=n, element_shape=[n_metrics])
            stamps = tf.TensorArray(tf.float64, size=n + 1)
            marks = tf.TensorArray(tf.float64, size=n)
            if settled is None:
                stamps = stamps.write(0, tf.timestamp())
            for group in tf.range(n // unroll):
                # Steps are strictly sequential: without this, iterations overlap and timestamps lie.
                tf.autograph.experimental.set_loop_options(parallel_iterations=1)
                for j in range(unroll):  # a Python loop: the steps laid out in the graph
                    i = group * unroll + j
                    x, y = next(iterator)
                    loss, metrics, done, mark, began = one_step(x, y, state)
                    losses = losses.write(i, loss)
                    metric_values = metric_values.write(i, metrics)
                    marks = marks.write(i, mark)
                    if settled is None:
                        with tf.control_dependencies([loss, *done]):
                            stamps = stamps.write(i + 1, tf.timestamp())
                    else:
                        stamps = stamps.write(i, began)
            if settled is not None:
                with tf.control_dependencies([settled()]):
                    stamps = stamps.write(n, tf.timestamp())
            return losses.stack(), metric_values.stack(), stamps.stack(), marks.stack()

        return train_steps

    unroll = UNROLL  # as this job's functions were made, whatever the module's value later
    grouped, single = make(unroll), make(1)

    def train_steps(iterator, n, state, variables):
        n = int(n)  # the steps of this call: which function, then its argument (a tensor: no trace per count)
        return (grouped if n % unroll == 0 else single)(iterator, host_scalar(n, tf.int32), state, variables)

    def tracing_count() -> int:  # as a ``tf.function``'s: traces of both
        return grouped.experimental_get_tracing_count() + single.experimental_get_tracing_count()

    def captured(iterator, n, state, variables) -> list:
        """The resources the trace serving such a call captured (``reuse.captured_resources``)."""
        function = grouped if int(n) % unroll == 0 else single
        return captured_resources(function.get_concrete_function(iterator, host_scalar(int(n), tf.int32), state, variables))

    train_steps.experimental_get_tracing_count = tracing_count
    train_steps.captured = captured
    return train_steps


def _async_steps(shared, n_metrics: int, packed: bool, output_device: str | None):
    """A program's async-ps step function (``steps_in_one_call``); its traces reach the job calling it now.

    The job is reached through a weak reference to ``shared``: the function and what shares it make no reference
    cycle, so that it leaves the tasks when the cache lets go of it, not when the garbage collector runs."""
    ref = weakref.ref(shared)

    def one_step(x, y, state):
        residuals, prefetched = state
        return ref().current.async_step(x, y, residuals or None, prefetched or None, packed, output_device)

    settled = (lambda: _written(ref().current.targets)) if packed else None
    return steps_in_one_call(one_step, n_metrics, settled)


@dataclass
class StepFunctions:
    """The compiled functions of one job; built once, traced on first use."""

    model: Any
    optimizer: Any
    loss_fn: Callable
    metric_fns: dict[str, Callable]
    targets: list | None = None  # what the optimizer updates: variables, or shards of partitioned ones
    splits: list | None = None  # per trainable variable: rows of each shard, or None
    packing: Any = None  # ps strategies: parameters and gradients travel packed (``packing.Packing``)
    traced: int = 0  # traces of the step function this job made (0: it called one another job traced), kept at its end
    reused: bool = False  # the job's steps ran in a step function another job of the same program traced
    job_name: str | None = None  # the job these functions are of (``reuse.py``: who traced a shared function)

    def __post_init__(self):
        if self.targets is None:
            self.targets = list(self.model.trainable_variables)
            self.splits = [None] * len(self.targets)

    def forward(self, x, y, training: bool, model=None):
        import tensorflow as tf

        logits = (model or self.model)(x, training=training)
        loss = tf.reduce_mean(self.loss_fn(y, logits))
        metrics = [tf.cast(fn(y, logits), tf.float32) for fn in self.metric_fns.values()]
        return loss, metrics

    def loss_and_grads(self, x, y, model=None):
        """Loss, metrics and the gradients of ``targets``; packed reads from the ps when ``packing`` is set."""
        import tensorflow as tf

        if self.packing is not None and model is None:
            return self._loss_and_grads_on(self.packing.read(), x, y)
        model = model or self.model
        with tf.GradientTape() as tape:
            loss, metrics = self.forward(x, y, training=True, model=model)
            scaled = loss + sum(model.losses) if model.losses else loss
        # per shard for partitioned variables: in the order of ``targets``
        grads = tape.gradient(scaled, [shard for v in model.trainable_variables for shard in shards_of(v)])
        return loss, metrics, grads

    def _loss_and_grads_on(self, pieces: list, x, y):
        """``loss_and_grads`` on the targets' values ``pieces`` (read packed: ``packing.read``).

        The model runs on those values through a ``keras.StatelessScope``; what its forward pass
        assigns (a BatchNormalization's moving statistics, a Dropout's seed state) is written to
        the variables afterwards, as a call outside the scope would have done.
        """
        import keras
        import tensorflow as tf

        model = self.model
        with tf.GradientTape() as tape:
            tape.watch(pieces)
            values, at = [], 0
            for split in self.splits:  # one value per trainable variable: a partitioned one from its shards
                count = 1 if split is None else len(split)
                values.append(pieces[at] if split is None else tf.concat(pieces[at:at + count], 0))
                at += count
            mapping = list(zip(model.trainable_variables, values))
            with keras.StatelessScope(mapping, collect_losses=True) as scope:
                given = dict(scope.state_mapping)
                loss, metrics = self.forward(x, y, training=True)
                extra = model.losses
                scaled = loss + sum(extra) if extra else loss
        for variable in model.variables:
            new = scope.get_current_value(variable)
            if new is not None and new is not given.get(id(variable)):
                variable.assign(new)
        return loss, metrics, tape.gradient(scaled, pieces)

    def placed_gradients(self, x, y, output_device: str):
        """Loss, metrics and gradients of a model whose layers run on their own devices.

        The loss runs on ``output_device`` (the last layer's), and every gradient op with its
        forward op (TF1's ``colocate_gradients_with_ops``): TF2's tape would run the backward pass
        on the caller's device.
        """
        import tensorflow as tf

        logits = self.model(x, training=True)
        with tf.device(output_device):
            loss = tf.reduce_mean(self.loss_fn(y, logits))
            metrics = [tf.cast(fn(y, logits), tf.float32) for fn in self.metric_fns.values()]
            total = loss + sum(self.model.losses) if self.model.losses else loss
        variables = self.model.trainable_variables
        grads = tf.compat.v1.gradients(total, [tf_variable(v) for v in variables], colocate_gradients_with_ops=True)
        return loss, metrics, grads

    def build_async(self, output_device: str | None = None, overlap: bool = False):
        """``train_steps``; with ``output_device``, for a placed (model-parallel) model.

        With ``packing``, a step reads the parameters packed, pushes its gradients packed once its
        mark is taken, and waits for nothing from the ps: its next read does (``steps_in_one_call``).
        With ``overlap`` (``wb.AsyncPS(overlap=True)``), a step computes on
        parameters prefetched into a variable on its worker while the next step's are read from the
        ps, so the read of one step and the push of the other share the link's two directions.

        A job of a program another job of this connection traced calls that job's function (``reuse.py``).
        """
        packed = self.packing is not None and output_device is None
        overlap = packed and overlap
        self._packed, self._overlap, self._variables = packed, overlap, job_variables(self)
        key = program_key(self, self._variables, ("async", packed, overlap, output_device, UNROLL))
        shared, found = CACHE.take(key, self, self.owner)
        if not found:
            shared.functions = _async_steps(shared, len(self.metric_fns), packed, output_device)
        self.reused = shared.reused_by(self.owner)
        self._shared = shared

    @property
    def owner(self) -> Any:
        """Who these functions are of: the job's name, the same after a ps's restore built them again."""
        return self.job_name or id(self)

    def _state_on(self, device: str) -> tuple[list, list]:
        """The worker's own variables on ``device``: error feedback (int8), prefetched parameters (overlap)."""
        residuals = self.packing.residuals_on(device) if self._packed else None
        prefetched = self.packing.prefetched_on(device) if self._overlap else None
        return residuals or [], prefetched or []

    def async_step(self, x, y, residuals, prefetched, packed: bool, output_device: str | None):
        """One async-ps step of this job (traced inside ``steps_in_one_call``): loss, metrics, ops to wait for,
        the mark of its gradients, and when its parameters arrived (packed reads)."""
        import tensorflow as tf

        began = None
        if packed:
            pieces = self.packing.read(prefetched)
            began = stamp_after(pieces)
            loss, metrics, grads = self._loss_and_grads_on(pieces, x, y)
        elif output_device is None:
            loss, metrics, grads = self.loss_and_grads(x, y)
        else:
            loss, metrics, grads = self.placed_gradients(x, y, output_device)
        mark = stamp_after([loss, *grads])
        metrics = tf.stack(metrics) if metrics else tf.zeros([0])
        if packed:  # the push leaves after the mark
            # With overlap, the next step's parameters leave the ps as this step starts, while it computes
            # and pushes: both directions of the link work at once. Made before the update, so the update
            # waits for this read (TensorFlow orders a variable's reads and writes as written), not the
            # other way round. They miss this worker's own update (one step staler than without overlap;
            # other workers' updates arrive as in any async step).
            fresh = self.packing.read_parts() if prefetched is not None else None
            self.optimizer.apply_gradients(zip(self.packing.push(grads, after=mark, residuals=residuals), self.targets))
            if prefetched is None:
                return loss, metrics, [], mark, began
            with tf.control_dependencies([mark]):
                kept = [variable.assign(part) for variable, part in zip(prefetched, fresh)]
            return loss, metrics, kept, mark, began
        with tf.control_dependencies([mark]):  # the push starts after the mark: phases do not overlap
            updated = self.optimizer.apply_gradients(zip(grads, self.targets))
        return loss, metrics, [] if updated is None else [updated], mark, None

    def train_steps_on(self, device: str) -> Callable:
        """``train_steps`` for the worker ``device``: ``(iterator, n) -> (losses, metrics, stamps, marks)``.

        Every worker calls the same function, traced once (three workers' traces took a second of the
        kernel's time, GIL held, before their first steps), with its own variables as arguments; the
        call's device places the step's computation there.
        """
        state, variables, shared = self._state_on(device), self._variables, self._shared

        def train_steps(iterator, n):
            return call(shared, shared.functions, (iterator, n, state, variables), shared.functions.captured)

        return train_steps

    def forget_worker(self, device: str) -> None:
        """The worker on ``device`` was replaced: what lived there (prefetched parameters, error feedback) is made again."""
        if self.packing is not None:
            self.packing.forget(device)  # made again on its next call (``state_on``)

    def leave_shared(self) -> None:
        """No call of this job's runs the step function now: count its traces, and let a later job of the program
        call it (its traces reach that job then). Local: a job whose tasks do not all answer at its end, and so
        keeps what it made on them, does not keep the shared function to itself."""
        shared = getattr(self, "_shared", None)
        if shared is not None:
            self.traced += shared.leave(self)

    def release_steps(self) -> None:
        """The job ended: its validation functions go, and its step function unless another job may call it
        (``reuse.py``; their registrations on every task, one RPC each, made now in the job's thread rather than
        by the garbage collector at a random moment), and the variables the packing kept on the workers. What
        evaluation needs (model, loss, metrics) stays."""
        self.leave_shared()
        self._shared = self._variables = None
        self.__dict__.pop("_validation", None)
        if self.packing is not None:
            self.packing.release()

    def validation_on(self, device: str, make_dataset: Callable) -> Callable:
        """The validation function of the worker ``device`` (``evaluation_function``), made on first use."""
        functions = self.__dict__.setdefault("_validation", {})
        if device not in functions:
            functions[device] = self.evaluation_function(make_dataset)
        return functions[device]

    def evaluation_function(self, make_dataset: Callable) -> Callable:
        """A ``tf.function`` ``() -> (loss and metrics weighted by examples, examples)`` over one pass of
        ``make_dataset()`` (built inside it, so that it runs where the function is called)."""
        import tensorflow as tf

        quiet_retracing_of(*OWN_STEP_FUNCTIONS)  # every strategy validates through it, sync-ps's own steps or not
        n_metrics = len(self.metric_fns)

        @tf.function
        def evaluate():
            totals = tf.zeros([n_metrics + 1], tf.float64)
            count = tf.constant(0.0, tf.float64)
            for x, y in make_dataset():
                loss, metrics = self.forward(x, y, training=False)
                weight = tf.cast(tf.shape(y)[0], tf.float64)
                totals += weight * tf.cast(tf.stack([loss, *metrics]), tf.float64)
                count += weight
            return totals / tf.maximum(count, 1.0), count

        return evaluate
