"""Experiment tracking: each ``wb.train`` job one run in MLflow or Weights & Biases, from one callback.

``callbacks=[wb.tracking.MLflow()]`` or ``callbacks=[wb.tracking.WandB(project=...)]`` (``%wb train --tracking
mlflow``): the job's parameters, epoch metrics, per-worker series, faults and scales, and artifacts (model,
checkpoints, timeline) in one run per job (``base.py`` says what; ``mlflow_run.py``, ``wandb_run.py`` how).
The trackers' own Keras callbacks (``mlflow.keras.MlflowCallback``, ``wandb.integration.keras.WandbMetricsLogger``)
work in ``wb.train`` too, logging into the run active where ``wb.train`` was called.

The classes load on first use: ``import workbench`` imports no tracker (nor Keras) for them.
"""

from __future__ import annotations

__all__ = ["MLflow", "WandB", "callback_for"]

TRACKERS = {"mlflow": "MLflow", "wandb": "WandB"}


def __getattr__(name: str):
    if name == "MLflow":
        from .mlflow_run import MLflow

        return MLflow
    if name == "WandB":
        from .wandb_run import WandB

        return WandB
    raise AttributeError(f"module 'workbench.tracking' has no attribute {name!r}")


def callback_for(tracker: str):
    """The tracker callback ``%wb train --tracking NAME`` adds: ``"mlflow"`` or ``"wandb"``, with its defaults."""
    from ..errors import ConfigurationError

    name = TRACKERS.get(str(tracker).lower())
    if name is None:
        raise ConfigurationError(f"unknown tracker {tracker!r}: pass one of {', '.join(TRACKERS)} "
                                 "(or callbacks=[wb.tracking.MLflow(...)] / [wb.tracking.WandB(...)] for their options).")
    return __getattr__(name)()
