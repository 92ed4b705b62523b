"""MLflow internals the workbench uses, behind one function here (checked on: ``compat.FENCES``).

- ``caller_runs()`` / ``share_runs(shared)``: MLflow keeps its active runs in a stack per thread
  (``mlflow.tracking.fluent._active_run_stack``, a thread-local variable). ``wb.train`` calls Keras callbacks
  from the job's own thread, where that stack is empty: MLflow's fluent calls there (``mlflow.log_params``,
  ``mlflow.log_metrics``, what ``mlflow.keras.MlflowCallback`` calls) would each start a stray run and
  leave it running. The job's thread shares the stack of the thread that called ``wb.train`` instead, as if
  the callbacks ran there, as ``model.fit`` runs them: they log into the caller's active run, and a run
  they start is the caller's active run afterwards.
- ``current_experiment_id()``: the experiment ``mlflow.set_experiment`` chose in the calling thread
  (``mlflow.tracking.fluent._get_experiment_id``), where ``wb.tracking.MLflow`` puts its runs by default.
"""

from __future__ import annotations

import sys


def caller_runs() -> tuple | None:
    """This thread's stack of active MLflow runs, for ``share_runs`` in another; None where MLflow is not in use."""
    fluent = sys.modules.get("mlflow.tracking.fluent")  # never imports MLflow: a callback of it would have
    stack = getattr(fluent, "_active_run_stack", None)
    if stack is None or not hasattr(stack, "set"):
        return None
    return stack, stack.get()


def share_runs(shared: tuple | None) -> None:
    """Make this thread's MLflow fluent calls use the stack ``caller_runs`` took in another thread."""
    if shared is None:
        return
    stack, runs = shared
    if stack.get() is not runs:
        stack.set(runs)


def current_experiment_id() -> str:
    """The experiment MLflow's fluent calls in this thread would use (``mlflow.set_experiment``, the
    environment's ``MLFLOW_EXPERIMENT_NAME``/``_ID``, or the default one)."""
    from mlflow.tracking import fluent

    return fluent._get_experiment_id()
