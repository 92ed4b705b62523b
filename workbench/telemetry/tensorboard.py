"""What a distributed job adds to a TensorBoard log dir: one run per task, with what only such a job has.

Keras's ``TensorBoard`` callback writes the ``train`` and ``validation`` runs (loss, metrics, learning
rate) as it does for ``model.fit``. Beside them, ``TensorBoardSink`` writes one run per task (``worker-0``,
``worker-1``, ..., and a ps or other task when something happened to it, ``job`` for a scale) with what
``JobScalars`` computes (``job_scalars.py``): ``workbench/examples_per_second``, ``workbench/step_time_seconds``,
``workbench/staleness``, ``workbench/dropped_gradients``, ``workbench/bytes_per_step``, and
``workbench/faults`` and ``workbench/scales`` (text). The x axis is the job's global step.
"""

from __future__ import annotations

from pathlib import Path

LOCAL_DEVICE = "/job:localhost/replica:0/task:0/device:CPU:0"  # the kernel's own CPU, connected to a cluster or not


def run_name(task: str) -> str:
    """The TensorBoard run (a directory) of a task: ``worker:0`` -> ``worker-0``."""
    return task.replace(":", "-").replace("/", "-")


class TensorBoardSink:
    """The per-task runs of one job under ``log_dir``."""

    def __init__(self, log_dir: str | Path):
        from ..optional import require

        require("tensorboard", "TensorBoard logs (a keras.callbacks.TensorBoard callback)")
        self.log_dir = Path(log_dir)
        self._writers: dict = {}

    def _writer(self, task: str):
        import tensorflow as tf

        writer = self._writers.get(task)
        if writer is None:
            with tf.device(LOCAL_DEVICE):
                writer = self._writers[task] = tf.summary.create_file_writer(str(self.log_dir / run_name(task)))
        return writer

    def log_scalars(self, task: str, step: int, values: dict[str, float]) -> None:
        import tensorflow as tf

        with tf.device(LOCAL_DEVICE), self._writer(task).as_default(step=step):
            for tag, value in values.items():
                tf.summary.scalar(f"workbench/{tag}", float(value))

    def log_text(self, task: str, step: int, kind: str, text: str) -> None:
        import tensorflow as tf

        with tf.device(LOCAL_DEVICE), self._writer(task).as_default(step=step):
            tf.summary.text(f"workbench/{kind}", text)

    def end_job(self, state: str) -> None:
        for writer in self._writers.values():
            writer.flush()
            writer.close()
        self._writers = {}
