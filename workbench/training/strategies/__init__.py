"""The strategies: how the workers of a job train together.

Each strategy is a room (or a module) here, configured by its object in ``training/config.py``
(``wb.AsyncPS``, ``wb.SyncPS``, ``wb.AllReduce``, ``wb.ModelParallel``):

* ``ps/``: what both parameter-server strategies share: ``PsJob`` (variables on the ps tasks, one
  input pipeline per worker, checkpoints, following a scale), the worker slots and fault handling of
  a run (``runs.py``), packed transfers and their precision (``packing.py``);
* ``async_ps.py``: each worker claims chunks of steps and applies its own updates;
* ``sync_ps/``: the barrier on the first ps and its aggregate call (``steps.py``), and the run that
  drives it (``run.py``);
* ``allreduce/``: MultiWorkerMirroredStrategy on the worker engines: the kernel's side (``job.py``),
  the group of engines and what travels to them (``group.py``), the engines' side (``engine.py``) and
  ``%%wb spmd`` (``spmd.py``);
* ``placed.py``: model parallelism: the job that trains a placed model (``wb.place``, in
  ``training/placing.py``), its layers' tasks in the part of the ps tasks.

May import: ``job/``, ``fit/``, ``modelling/`` and the training package's options, config and data.

To add a strategy: write its configuration object in ``training/config.py`` (a ``Strategy`` subclass
whose class attributes say what it is: ``synchronous``, ``data_parallel``, ``leaves_workers_out``,
``variables_on_ps``, its TensorBoard scalars) and register it in ``STRATEGIES``; write its job here (a
``Job`` subclass providing ``_setup``, ``_run``, ``_save``, ``_restore_state``, ``model``, the
evaluation hooks and ``check_rescale``) and add it to ``JOBS`` below.
"""

from __future__ import annotations

from ..config import AllReduce, AsyncPS, ModelParallel, Strategy, SyncPS
from .allreduce.job import AllReduceJob
from .placed import PlacedJob
from .ps.job import PsJob

JOBS = {AsyncPS: PsJob, SyncPS: PsJob, AllReduce: AllReduceJob, ModelParallel: PlacedJob}


def job_class(strategy: Strategy) -> type:
    """The ``Job`` subclass that trains with ``strategy``."""
    return JOBS[type(strategy)]
