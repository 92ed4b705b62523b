"""The strategies: how the workers of a job train together, each a ``Trainer`` (``job/trainer.py``).

Each strategy is a room (or a module) here, configured by its object in ``training/config.py``
(``wb.AsyncPS``, ``wb.SyncPS``, ``wb.AllReduce``, ``wb.ModelParallel``), and implements the one
protocol a ``Job`` holds (``job/trainer.py``: set up, run steps into ``job.record_call``, save and
restore, follow a scale, evaluate, validate, the callbacks' model, the local model):

* ``ps/``: what both parameter-server strategies share: ``PsTrainer`` (``trainer.py``: variables on the
  ps tasks, one input pipeline per worker, checkpoints, following a scale), the worker slots and fault
  handling of a run (``runs.py``), packed transfers and their precision (``packing.py``);
* ``async_ps.py``: each worker claims chunks of steps and applies its own updates;
* ``sync_ps/``: the barrier on the first ps and its aggregate call (``steps.py``), and the run that
  drives it (``run.py``);
* ``allreduce/``: MultiWorkerMirroredStrategy on the worker engines: the kernel's side (``trainer.py``),
  the group of engines and what travels to them (``group.py``), the engines' side (``engine.py``) and
  ``%%wb spmd`` (``spmd.py``);
* ``placed.py``: model parallelism: ``PlacedTrainer`` trains a placed model (``wb.place``, in
  ``training/placing.py``), its layers' tasks in the part of the ps tasks.

May import: ``job/``, ``fit/``, ``modelling/`` and the training package's options, config and data.

To add a strategy: write its configuration object in ``training/config.py`` (a ``Strategy`` subclass
whose class attributes say what it is: ``synchronous``, ``data_parallel``, ``leaves_workers_out``,
``variables_on_ps``, its TensorBoard scalars) and register it in ``STRATEGIES``; write its trainer here
(a class implementing ``job.trainer.Trainer``, holding its job through ``HeldByJob``) and add it to
``TRAINERS`` below.
"""

from __future__ import annotations

from ..config import AllReduce, AsyncPS, ModelParallel, Strategy, SyncPS
from .allreduce.trainer import AllReduceTrainer
from .placed import PlacedTrainer
from .ps.trainer import PsTrainer

TRAINERS = {AsyncPS: PsTrainer, SyncPS: PsTrainer, AllReduce: AllReduceTrainer, ModelParallel: PlacedTrainer}


def trainer_class(strategy: Strategy) -> type:
    """The ``Trainer`` that trains with ``strategy``."""
    return TRAINERS[type(strategy)]
