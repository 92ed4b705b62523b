"""The job that trains a placed model (``wb.place``): its layers' tasks take the part of ps tasks.

``wb.train`` takes it for ``wb.ModelParallel`` (``strategies.JOBS``); a placed model (``training/placing.py``) is what it trains.
"""

from __future__ import annotations

from typing import Any

from ...cluster.process import connection
from ...errors import ClusterStateError
from ..modelling.building import build_optimizer, update_where_the_variable_lives
from ..modelling.losses import resolve_loss, resolve_metrics
from ..modelling.placement import task_of
from ..modelling.steps import StepFunctions
from .async_ps import AsyncRun
from .ps.job import PsJob


class PlacedJob(PsJob):
    """Training of a ``PlacedModel``: one input pipeline, the layers' tasks in turn, several steps per call.

    The tasks holding layers play the part of ps tasks: if one is lost, the job re-hosts it, places the
    model again (``placed.model`` is then the new one) and restores its newest checkpoint.
    """

    _holders = "task holding layers of the placed model"

    def _setup(self, cluster, model: Any, data, loss, optimizer, options) -> None:
        """``model`` is the ``PlacedModel`` (``wb.place``); its module imports this one, so it is not named here."""
        self._epoch = connection.connect(cluster, holder=self)
        connection.check_epoch(model._epoch, "this placed model")
        self._placed = model
        self._model_source = model.source
        self._ps_names = list(dict.fromkeys(task_of(d) for d in model.layer_devices.values()))
        self._ps_devices = [f"{cluster.task(n).task.device}/device:CPU:0" for n in self._ps_names]
        first_task = task_of(model.input_device)
        self._workers = [r for r in cluster.tasks if r.name == first_task] or self._workers[:1]
        self._worker_devices = [model.input_device]
        self._seed = self._probe_data(data, options)
        self._loss_fn = resolve_loss(loss)
        self._build_variables()
        self._setup_checkpoints(resume=options.resume)
        self._iterators = [self._make_iterator(0)]

    def _build_variables(self) -> None:
        import tensorflow as tf

        self._model = self._placed.model
        self._optimizer = build_optimizer(self._optimizer_source)
        update_where_the_variable_lives(self._optimizer)
        self._optimizer.build(self._model.trainable_variables)  # slots are created beside their variables
        with tf.device(self._placed.input_device):
            self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="workbench_step")
        self._fns = StepFunctions(self._model, self._optimizer, self._loss_fn, resolve_metrics(self.options.metrics))

    def _restore_state(self) -> int:
        self._placed.place_again()
        return super()._restore_state()

    def check_rescale(self, workers: int) -> None:
        raise ClusterStateError(
            f"cannot scale cluster {self.cluster.name!r} while {self.describe()} trains a placed model: its layers "
            "live on the tasks wb.place chose. Wait for the job (job.wait()) or stop it, then scale and place again.")

    def _async_step_options(self) -> dict:
        return {"output_device": self._placed.output_device}

    def _run(self) -> None:
        AsyncRun(self).run()

    @property
    def info(self) -> dict:
        info = super().info
        info.update(layers=dict(self._placed.layer_tasks), input_device=self._placed.input_device,
                    output_device=self._placed.output_device)
        return info
