"""sync-ps on the tasks themselves: the barrier lives on the first ps, and each remote call runs many steps.

The kernel no longer drives every step (that was three round trips per step through this process).
What TensorFlow 1's ``SyncReplicasOptimizer`` kept on the ps (gradient accumulators, a token
queue), rebuilt here with TF2 queues and functions:

* ``gradients``: one queue on the first ps. A worker's step ends by enqueueing
  ``(meta, *gradients)`` there: that enqueue is the push. ``meta`` is one float64 vector
  ``[step, worker, loss, started, ready, *metrics]`` (``META``): every tensor that crosses from a
  worker to the ps is a transfer of its own, with its CPU cost on both sides, so the small values
  travel together. The gradients travel packed, one tensor per ps and dtype (``packing``), as the
  parameters do.
* ``tokens[w]``: one queue per worker, on the first ps. A worker computes step ``s`` once it
  dequeued the token ``s``, i.e. once step ``s - 1`` is applied; it then reads the parameters
  (from the ps, in its forward pass). A worker that fell behind drains its queue and jumps to the
  newest token: its old gradients come late and are dropped.
* ``aggregate(first, end, next_token)`` runs on the first ps, steps ``first..end-1`` in one call:
  for each step it dequeues gradients until ``required`` of them belong to this step (older ones
  are counted late), writes each into its worker's row of ``slots`` (variables on the ps, written
  in place; late ones into a spare row), averages the rows of the step's workers in worker order
  (the same sum whatever the arrival order), applies the average, and hands every worker the next
  token.
* ``work[w](iterator, end)`` runs on worker ``w``: steps from its token until the token reaches
  ``end``; it puts its last token back for its next call. Every worker calls one function, traced
  once, with its own token queue, index and error-feedback variables as arguments.

Both functions take the queues' handles and every variable they reach as arguments: a later job of the same
program on the connection calls the functions an earlier job traced and set up (``modelling/reuse.py``).

``required`` is a variable on the ps the kernel lowers when a worker is lost, hung or dropped (and
raises when it is back), followed by a *wake* element on the gradient queue (worker ``-1``) so that
a waiting ``aggregate`` reads it again. Closing the queues ends every blocked call (``close()``).
"""

from __future__ import annotations

import os
import uuid
import weakref
from typing import Any

from ...modelling.reuse import CACHE, call, captured_resources, job_variables, program_key
from ...modelling.steps import StepFunctions, _written, host_scalar, stamp_after
from ..ps.packing import Packing

WAKE = -1  # the worker index of an element that only makes ``aggregate`` look at ``required`` again
META = 5  # step, worker, loss, started, ready; then the metrics
_QUEUE_CAPACITY = 1 << 16


class SyncBarrier:
    """The queues and functions of one sync-ps run (a run after a ps restore makes new ones)."""

    def __init__(self, fns: StepFunctions, n_workers: int, n_metrics: int, ps_device: str, required: int):
        import tensorflow as tf

        self.fns, self.n, self.n_metrics, self.ps_device = fns, n_workers, n_metrics, ps_device
        self.packing = fns.packing or Packing(fns.targets, grouped=False)  # a gradient travels in these parts
        self._specs = self.packing.specs()  # as they travel (encoded: ``transfer``)
        self.devices: list[str] = []  # the workers' devices, known from ``warm_up`` on
        with tf.device(ps_device):
            self.required = tf.Variable(required, dtype=tf.int32, trainable=False, name="sync_required")
            self.gradients = _Queue([tf.float64, *(d for d, _ in self._specs)],
                                    [[META + n_metrics], *(s for _, s in self._specs)])
            # a step's gradients as they came, decoded: row w is worker w's, row n takes what came late
            self.slots = [tf.Variable(tf.zeros([n_workers + 1, *s], d), trainable=False, name="sync_slots")
                          for d, s in self.packing.specs(wire=False)]
            self.tokens = [_Queue([tf.int64], [[]]) for _ in range(n_workers)]
        # what the functions reach, as arguments: the job's variables and the barrier's (``reuse.py``)
        self._variables = [*job_variables(fns), self.required, *self.slots]
        key = program_key(fns, self._variables, ("sync", n_workers, n_metrics, ps_device, repr(self._specs),
                                                 fns.packing is None))
        self._shared, found = CACHE.take(key, self, fns.owner)
        if not found:
            self._shared.functions = (_make_work(self._shared), _make_aggregate(self._shared, n_workers, n_metrics))
        fns.reused = self._shared.reused_by(fns.owner)
        self.work: list[Any] = [self._work_of(w) for w in range(n_workers)]

    # -- from the kernel -----------------------------------------------------------------------

    def start(self, step: int) -> None:
        """Every worker's first token: the first step to compute."""
        import tensorflow as tf

        first = host_scalar(step, tf.int64)
        with tf.device(self.ps_device):
            for tokens in self.tokens:
                tokens.enqueue([first])

    def warm_up(self, iterators: list, worker_devices: list[str], step: int, skip: set[int] = frozenset()) -> None:
        """Run each function once with nothing to do, one after the other, before the real calls.

        A first call registers a function on its tasks and opens their channels; the first calls
        made all at once, with ``aggregate`` blocking on the ps meanwhile, hung. Workers in ``skip``
        (being re-hosted) warm up when they are back.
        """
        import tensorflow as tf

        at = host_scalar(step, tf.int64)
        self.devices = list(worker_devices)
        for index, (work, iterator, device) in enumerate(zip(self.work, iterators, worker_devices)):
            if index in skip:
                continue
            with tf.device(device):
                work(iterator, at).numpy()  # its token is there and not below ``at``: no step runs
        with tf.device(self.ps_device):
            self.aggregate(at, at, at).numpy()

    def set_required(self, required: int) -> None:
        """How many of a step's gradients ``aggregate`` waits for; a waiting one looks again at once."""
        import tensorflow as tf

        with tf.device(self.ps_device):
            self.required.assign(required)
            meta = tf.concat([tf.constant([-1.0, WAKE], tf.float64), tf.zeros([META - 2 + self.n_metrics], tf.float64)], 0)
            self.gradients.enqueue([meta, *(tf.zeros(s, d) for d, s in self._specs)])

    def rebuild_worker(self, index: int) -> None:
        """Worker ``index`` was re-hosted: its error-feedback state went with it (made again on its next call)."""
        if self.devices:
            self.packing.forget(self.devices[index])

    def leftover(self) -> int:
        """Gradients still queued (after the last step): they came late."""
        import tensorflow as tf

        with tf.device(self.ps_device):
            return int(self.gradients.size().numpy())

    def close(self) -> None:
        """End every call blocked on the queues (a finished or failed run): their waits fail at once; then the queues
        go from the ps. The functions stay for a later job of the program; what they reach of this run goes."""
        import tensorflow as tf

        queues = (self.gradients, *self.tokens)
        with tf.device(self.ps_device):
            try:
                for queue in queues:
                    queue.close()
            finally:
                for queue in queues:
                    queue.destroy()
                self.fns.traced += self._shared.leave(self)

    def aggregate(self, first, end, next_token):
        """Steps ``first..end-1`` applied on the first ps (``_make_aggregate``): their rows."""
        return self._call(1, first, end, next_token, self.gradients.handle, [t.handle for t in self.tokens],
                          self._variables)

    def _call(self, which: int, *args):
        """Call the barrier's function ``which`` (0: work, 1: aggregate); a new trace that captured a resource of
        this run (where every one should be an argument) keeps the functions to this job (``reuse.py``)."""
        function = self._shared.functions[which]
        return call(self._shared, function, args, lambda *a: captured_resources(function.get_concrete_function(*a)))

    @property
    def row_width(self) -> int:
        """The values ``aggregate`` returns per step: mask, losses, metrics, stamps (n each, metrics n x m), applied, late."""
        return self.n * (4 + self.n_metrics) + 3

    def unpack(self, row) -> tuple:
        """One step's row of ``aggregate``: (mask [n], losses [n], metrics [n, m], stamps [n, 2], applied [2], late)."""
        n, m = self.n, self.n_metrics
        ends = [n, 2 * n, 2 * n + n * m, 4 * n + n * m, 4 * n + n * m + 2]
        mask, losses, metrics, stamps, applied = (row[a:b] for a, b in zip([0, *ends[:-1]], ends))
        return mask, losses, metrics.reshape(n, m), stamps.reshape(n, 2), applied, int(row[-1])

    # -- the functions -------------------------------------------------------------------------

    @staticmethod
    def _newest(tokens, after: list):
        """Once ``after`` ran, dequeue a token (waiting for one), then any others queued behind it: the newest step.

        ``tokens`` is the queue's handle (a function argument: one trace serves every worker's queue).
        Only the first dequeue waits for ``after`` (both on the ps): a control edge to an op on the
        worker would be one more transfer per step. The rest stays where TensorFlow places it: pinning
        the maximum to the ps moved the loop's own bookkeeping across the link (12 transfers a step
        instead of 9, in the partitioned graphs).
        """
        import tensorflow as tf

        with tf.control_dependencies(after):
            first = tf.raw_ops.QueueDequeueV2(handle=tokens, component_types=[tf.int64])[0]
        with tf.control_dependencies([first]):
            size = tf.raw_ops.QueueSizeV2(handle=tokens)
            more = tf.raw_ops.QueueDequeueManyV2(handle=tokens, n=size, component_types=[tf.int64])[0]
        return tf.reduce_max(tf.concat([tf.reshape(first, [1]), more], 0))

    @staticmethod
    def split_rows(rows) -> tuple:
        """A ``work`` call's fetched rows -> (step numbers, ``[started, ready]`` per step)."""
        return rows[:, 0].astype("int64"), rows[:, 1:]

    def _work_of(self, index: int):
        """``work[index](iterator, end) -> rows``: worker ``index``'s call of the shared function."""
        import tensorflow as tf

        def work(iterator, end):
            residuals = self.packing.residuals_on(self.devices[index]) or []
            return self._call(0, iterator, end, tf.constant(index, tf.int32), self.tokens[index].handle, residuals,
                              self.gradients.handle, self._variables)

        return work


class _Queue:
    """A FIFO queue on the device in scope, held by its handle, that goes when ``destroy()`` is called.

    ``tf.queue.FIFOQueue`` deletes its queue when the Python object is collected, by an op on the queue's task;
    after that task was lost and re-hosted the op fails, and the failure is printed from a finalizer (a traceback
    in whatever cell runs then). A barrier's queues go in ``close()`` instead, where a ps that is gone is expected.
    """

    def __init__(self, types: list, shapes: list):
        import tensorflow as tf

        self.handle = tf.raw_ops.FIFOQueueV2(component_types=types, shapes=shapes, capacity=_QUEUE_CAPACITY,
                                            shared_name=f"workbench_sync_{os.getpid()}_{uuid.uuid4().hex}")
        # the name is the queue's on its task, where other clients of the cluster (an attached kernel) make theirs

    def enqueue(self, components: list) -> None:
        import tensorflow as tf

        tf.raw_ops.QueueEnqueueV2(handle=self.handle, components=components)

    def size(self):
        import tensorflow as tf

        return tf.raw_ops.QueueSizeV2(handle=self.handle)

    def close(self) -> None:
        """Blocked and later dequeues fail at once; pending enqueues are cancelled (a destroyed queue: nothing)."""
        import tensorflow as tf

        if self.handle is None:
            return
        tf.raw_ops.QueueCloseV2(handle=self.handle, cancel_pending_enqueues=True)

    def destroy(self) -> None:
        """The queue goes from its task; a task that is gone took it with it (nothing to do, nothing printed)."""
        import tensorflow as tf

        handle, self.handle = self.handle, None
        if handle is None:
            return
        try:
            tf.raw_ops.DestroyResourceOp(resource=handle, ignore_lookup_error=True)
        except tf.errors.OpError:
            pass


def _dequeue(queue, types: list, shapes: list) -> list:
    """``FIFOQueue.dequeue`` on a queue's handle (a function argument), its components' shapes set as it sets them."""
    import tensorflow as tf

    item = tf.raw_ops.QueueDequeueV2(handle=queue, component_types=types)
    for tensor, shape in zip(item, shapes):
        tensor.set_shape(shape)
    return item


def _make_work(shared):
    """``work(iterator, end, index, tokens, residuals, gradients, variables) -> rows``: a worker's steps until its
    token reaches ``end``.

    Each step waits for its token (the previous step applied), then reads the parameters in
    its forward pass and pushes its gradient to the ps; its row is ``(step, started, ready)``:
    when it started (token in hand) and when its gradient was ready (``split_rows``). The last
    token, ``end`` or beyond, is put back for the next call. The queues come as handles and every variable as
    an argument: one trace serves every worker and every run of the program; its Python reaches the barrier
    calling it now (``shared.current``), through a weak reference (no cycle keeps the function alive).
    """
    import tensorflow as tf

    ref = weakref.ref(shared)

    @tf.function(autograph=False)
    def work(iterator, end, index, tokens, residuals, gradients, variables):
        barrier = ref().current
        fns, packing = barrier.fns, barrier.packing
        targets = fns.targets
        worker = tf.cast(index, tf.float64)

        def more(step, steps, stamps):
            return step < end

        def one(step, steps, stamps):
            with tf.control_dependencies([step]):  # the previous step is applied
                start = tf.timestamp()
            with tf.control_dependencies([start]):
                x, y = next(iterator)
            # no edge from ``start`` to the reads on the ps: they run in this iteration of the loop there, which
            # begins once the loop's condition on ``step`` crossed over, i.e. after the token came
            loss, metrics, grads = fns.loss_and_grads(x, y)
            grads = packing.encode(packing.pack([tf.convert_to_tensor(g, t.dtype) for g, t in zip(grads, targets)]),
                                   residuals or None)
            times = tf.stack([start, stamp_after([loss, *grads])])
            meta = tf.concat([tf.stack([tf.cast(step, tf.float64), worker, tf.cast(loss, tf.float64)]), times,
                              tf.cast(tf.stack(metrics), tf.float64) if metrics else tf.zeros([0], tf.float64)], 0)
            # two transfers to the ps: the small values, the gradients
            pushed = tf.raw_ops.QueueEnqueueV2(handle=gradients, components=[meta, *grads])
            at = steps.size()
            steps, stamps = steps.write(at, step), stamps.write(at, times)
            return SyncBarrier._newest(tokens, [pushed]), steps, stamps

        loop = (SyncBarrier._newest(tokens, []), tf.TensorArray(tf.int64, size=0, dynamic_size=True),
                tf.TensorArray(tf.float64, size=0, dynamic_size=True, element_shape=[2]))
        last, steps, stamps = tf.while_loop(more, one, loop, parallel_iterations=1)
        back = tf.raw_ops.QueueEnqueueV2(handle=tokens, components=[last])
        with tf.control_dependencies([back]):  # one tensor: the kernel fetches it in one round trip
            return tf.concat([tf.reshape(tf.cast(steps.stack(), tf.float64), [-1, 1]),
                              tf.reshape(stamps.stack(), [-1, 2])], 1)

    return work


def _make_aggregate(shared, n: int, m: int):
    """``aggregate(first, end, next_token, gradients, tokens, variables) -> rows``, on the first ps (as
    ``_make_work``: queues as handles, variables as arguments, the barrier reached through ``shared``)."""
    import tensorflow as tf

    ref = weakref.ref(shared)

    def gather(barrier, gradients, step):
        """Dequeue until ``required`` gradients of ``step`` came, each into its worker's slot: who, and how many late.

        Only the small per-worker values are carried through the loop; a gradient is written once,
        in place, into its row of ``slots`` (a late one, or a wake element, into the spare row ``n``).
        """
        slots, required = barrier.slots, barrier.required
        types = [tf.float64, *(d for d, _ in barrier._specs)]
        shapes = [[META + m], *(s for _, s in barrier._specs)]

        def more(count, late, mask, meta):
            return count < required.read_value()

        def take(count, late, mask, meta):
            item = _dequeue(gradients, types, shapes)
            index = tf.cast(item[0][1], tf.int32)
            known = index >= 0
            worker = tf.maximum(index, 0)
            fresh = tf.logical_and(known, tf.equal(tf.cast(item[0][0], tf.int64), step))
            fresh = tf.logical_and(fresh, tf.gather(mask, worker) == 0.0)  # once per worker and step
            row = tf.where(fresh, worker, n)
            written = [s.scatter_update(tf.IndexedSlices(tf.expand_dims(g, 0), tf.reshape(row, [1])))
                       for s, g in zip(slots, barrier.packing.decode(list(item[1:])))]
            late += tf.cast(tf.logical_and(known, tf.logical_not(fresh)), tf.int32)
            weight = tf.cast(fresh, tf.float32)
            mask = tf.tensor_scatter_nd_add(mask, [[worker]], [weight])
            meta = tf.tensor_scatter_nd_add(meta, [[worker]], [item[0] * tf.cast(weight, tf.float64)])
            with tf.control_dependencies(written):
                return count + tf.cast(fresh, tf.int32), late, mask, meta

        start = (tf.constant(0), tf.constant(0), tf.zeros([n]), tf.zeros([n, META + m], tf.float64))
        return tf.while_loop(more, take, start, parallel_iterations=1)

    @tf.function(autograph=False)
    def aggregate(first, end, next_token, gradients, tokens, variables):
        barrier = ref().current
        fns, slots = barrier.fns, barrier.slots

        def step_body(step, out):
            count, late, mask, meta = gather(barrier, gradients, step)
            with tf.control_dependencies([count]):
                applied = tf.timestamp()
            share = tf.cast(tf.maximum(count, 1), tf.float32)
            rows = tf.reshape(tf.where(mask > 0), [-1])  # the step's workers, in worker order: the same sum always
            mean = [tf.reduce_sum(tf.gather(s, rows), axis=0) / tf.cast(share, s.dtype) for s in slots]
            losses, stamps = tf.cast(meta[:, 2], tf.float32), meta[:, 3:5]
            metrics = tf.cast(meta[:, META:], tf.float32)
            with tf.control_dependencies([applied]):
                fns.optimizer.apply_gradients(zip(barrier.packing.unpack(mean), fns.targets))
            with tf.control_dependencies([_written(fns.model.weights)]):
                token = tf.where(step + 1 < end, step + 1, next_token)
                handed = [tf.raw_ops.QueueEnqueueV2(handle=t, components=[token]) for t in tokens]
            with tf.control_dependencies(handed):
                done = tf.timestamp()
            row = tf.concat([tf.cast(tf.reshape(v, [-1]), tf.float64)
                             for v in (mask, losses, metrics, stamps, tf.stack([applied, done]), late)], 0)
            return step + 1, out.write(tf.cast(step - first, tf.int32), row)

        out = tf.TensorArray(tf.float64, size=tf.cast(end - first, tf.int32), element_shape=[barrier.row_width])
        _, out = tf.while_loop(lambda step, _out: step < end, step_body, (first, out), parallel_iterations=1)
        return out.stack()  # one tensor: the kernel fetches it in one round trip

    return aggregate
