"""``cluster.device(...)``: a ``tf.device`` scope on one task, this kernel connected to its cluster first and the task
proven to answer within a timeout (a task that answers nothing would otherwise freeze the kernel: see ``_reach``)."""

from __future__ import annotations

from ... import native_logs
from ...errors import ClusterStateError, ConfigurationError
from . import connection


def device_scope(cluster, record, device_type: str, index: int, timeout: float):
    """``cluster.device(...)``: a ``tf.device`` scope on the task of ``record``, this kernel connected first and
    the task proven to answer within ``timeout`` s."""
    import tensorflow as tf

    device_type = device_type.upper()
    if device_type not in ("CPU", "GPU"):
        raise ConfigurationError(f"device_type={device_type!r}: use 'CPU' or 'GPU'.")
    name = f"{record.task.device}/device:{device_type}:{index}"
    if record.devices and name not in record.devices:
        raise ConfigurationError(
            f"{record.name} has no device {device_type}:{index}: its devices are "
            f"{', '.join(d.rsplit('/device:', 1)[-1] for d in record.devices)}.")
    cluster.job_queue.require_idle(f"place work on {record.name}")
    connection.connect(cluster)
    _reach(tf, name, record.name, timeout)
    return tf.device(name)


def _reach(tf, device: str, task: str, timeout: float) -> None:
    """Prove that ``task`` answers before a scope places work on ``device``, waiting at most ``timeout`` s.

    Under a scope on another task TensorFlow copies each Python value an op takes to that task while it
    holds the GIL: to a task that answers nothing (stopped, overloaded, its host gone) the copy froze the
    whole process, every thread and interrupts included, until the task came back. ``connection.touch`` waits
    with the GIL released, so the wait is bounded.
    """
    try:
        connection.bounded(lambda: connection.touch(tf, device), timeout, f"reaching {task} before placing work on it",
                           breaks=False)
    except TimeoutError as exc:
        raise ClusterStateError(
            f"{exc}: the task is not answering (stopped, overloaded, or behind a firewall; see cluster.status()). "
            "Nothing was placed on it: run the cell again once it answers." + native_logs.hint()) from None
