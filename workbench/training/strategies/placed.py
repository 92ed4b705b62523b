"""The trainer of a placed model (``wb.place``): its layers' tasks take the part of ps tasks.

``wb.train`` takes it for ``wb.ModelParallel`` (``strategies.TRAINERS``); a placed model (``training/placing.py``) is what
it trains.
"""

from __future__ import annotations

from ...cluster.process import connection
from ...errors import ClusterStateError
from ..modelling.building import build_optimizer, update_where_the_variable_lives
from ..modelling.losses import resolve_metrics
from ..modelling.placement import task_of
from ..modelling.steps import StepFunctions
from .async_ps import AsyncRun
from .ps.trainer import PsTrainer


class PlacedTrainer(PsTrainer):
    """Training of a ``PlacedModel``: one input pipeline, the layers' tasks in turn, several steps per call.

    The tasks holding layers play the part of ps tasks: if one is lost, the job re-hosts it, places the
    model again (``placed.model`` is then the new one) and restores its newest checkpoint.
    """

    holders = "task holding layers of the placed model"

    def set_up(self) -> None:
        """``job.inputs.model`` is the ``PlacedModel`` (``wb.place``); its module imports this one, so it is not named here."""
        job = self.job
        placed = job.inputs.model
        self.epoch = connection.connect(job.cluster, holder=job)
        placed.check_connection()
        self.restore_tasks = list(dict.fromkeys(task_of(d) for d in placed.layer_devices.values()))
        self.ps_devices = [f"{job.cluster.task(n).task.device}/device:CPU:0" for n in self.restore_tasks]
        first_task = task_of(placed.input_device)
        job.workers = [r for r in job.cluster.tasks if r.name == first_task] or job.workers[:1]
        self.worker_devices = [placed.input_device]
        self.seed = self._probe_data()
        self._build_variables()
        self._setup_checkpoints(resume=self.options.resume)
        self.iterators = [self._make_iterator(0)]

    @property
    def _placed(self):
        return self.job.inputs.model

    @property
    def model_source(self):
        return self._placed.source  # what wb.place was given

    def _build_variables(self) -> None:
        import tensorflow as tf

        self._model = self._placed.model
        self.optimizer = build_optimizer(self.job.inputs.optimizer)
        update_where_the_variable_lives(self.optimizer)
        self.optimizer.build(self._model.trainable_variables)  # slots are created beside their variables
        with tf.device(self._placed.input_device):
            self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="workbench_step")
        self.fns = StepFunctions(self._model, self.optimizer, self.job.loss_fn, resolve_metrics(self.options.metrics),
                                 job_name=self.job.name)

    def restore(self, checkpoint: str | None, step: int) -> None:
        self._placed.place_again()
        super().restore(checkpoint, step)

    def check_rescale(self, workers: int) -> None:
        raise ClusterStateError(
            f"cannot scale cluster {self.job.cluster.name!r} while {self.job.describe()} trains a placed model: its "
            "layers live on the tasks wb.place chose. Wait for the job (job.wait()) or stop it, then scale and place again.")

    def async_step_options(self) -> dict:
        return {"output_device": self._placed.output_device}

    def run(self) -> None:
        AsyncRun(self.job, self).run()

    def info(self) -> dict:
        placed = self._placed
        return {**super().info(), "layers": dict(placed.layer_tasks), "input_device": placed.input_device,
                "output_device": placed.output_device}
