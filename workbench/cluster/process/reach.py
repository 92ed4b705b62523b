"""After a re-hosting: the new task and every other task of the cluster reach each other (``connection.refresh``)."""

from __future__ import annotations

import time

from ...compat import tensorflow as tf_compat
from ...errors import ClusterStateError, first_line


def await_links(cluster, rehosted: str, deadline: float, retry_seconds: float) -> None:
    """Wait until ``rehosted`` and every other task reach each other, both ways.

    A peer that called the old server while it was gone has its connection to that address backing
    off (gRPC waits up to seconds before it tries again); the first step after recovery must not
    find it so. Each try is a tiny function: the new task makes a value, each peer receives it and
    sends one back.
    """
    import tensorflow as tf

    target = f"{cluster.task(rehosted).task.device}/device:CPU:0"

    def peers_now() -> list[str]:  # a worker that a scale took out meanwhile is not waited for
        return [f"{r.task.device}/device:CPU:0" for r in cluster.tasks if r.name != rehosted]

    last, peers, round_trip = None, None, None
    while time.monotonic() < deadline:
        if (now := peers_now()) != peers:
            peers, round_trip = now, _round_trip(tf, target, now)
        try:
            round_trip().numpy()
            return
        except (tf.errors.UnavailableError, tf.errors.CancelledError, tf.errors.AbortedError) as exc:
            last = exc
        except tf.errors.OpError as exc:
            if peers == peers_now():
                raise
            last = exc  # a peer left while it was reached: again, with the peers there now
        time.sleep(retry_seconds)
    raise ClusterStateError(f"{rehosted} of cluster {cluster.name!r} was re-hosted, but the other tasks could not reach it "
                            f"in time: {first_line(last, 300) if last else 'no answer'}")


def _round_trip(tf, target: str, peers: list[str]):
    """A tiny function: ``target`` makes a value, each of ``peers`` receives it and sends one back."""

    def round_trip():
        total = tf.constant(0.0, tf.float64)
        for peer in peers:
            with tf.device(target):
                there = tf.timestamp()
            with tf.device(peer):
                back = there + 1.0
            with tf.device(target):
                total += back
        return total

    tf_compat.quiet_retracing_of(round_trip.__qualname__)  # one function per re-hosting, on its tasks: not a user's loop
    return tf.function(round_trip, autograph=False)
