"""The callbacks' model of an all-reduce job: a copy in the kernel of what the workers train."""

from __future__ import annotations

import weakref

from ...data import features_of
from ...modelling.building import learning_rate_of
from . import engine as allreduce_engine
from .group import GROUP_TIMEOUT


class CallbackMirror:
    """The callbacks' model of an all-reduce job: a local copy of the model, compiled like the job.

    Its weights, learning rate and iteration count are fetched from worker 0 the first time a callback
    reads ``callback.model`` in a hook (``read``); what the hook changed there (``set_weights``, as
    ``EarlyStopping(restore_best_weights=True)`` does, or the learning rate) is sent to every worker after it
    (``push_changes``).
    """

    def __init__(self, trainer):  # the job's AllReduceTrainer, which holds this copy
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
