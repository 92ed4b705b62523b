"""How TensorFlow's thread pools wait for work in the workbench's processes, and how many threads compute.

TensorFlow's pools (a device's intra-op pool, a context's inter-op pool) *spin* by default: a thread out of work
keeps looking for more for a while before it sleeps, which shortens the wait when the next op comes soon. A
workbench pool runs several tasks per machine (on the development machine, 1 ps + 3 workers and the kernel on 2
cores) and each step is many short ops split across them by transfers: a spinning thread burns a core the next
task needs. The workbench asks TensorFlow's pools to sleep at once (``ConfigProto.experimental.
disable_thread_spinning``) in the servers the engines host, in every context the kernel sets up on them and in an
all-reduce group's processes. ``WORKBENCH_THREAD_SPINNING=1`` in the environment the cluster is started from keeps
TensorFlow's default: a machine with a core to spare per busy thread may gain a little latency (a link-bound job
here lost about 2 % with sleeping pools, the CPU-bound lines of ``bench/training.py`` gained 10-20 %).

The tasks of one machine also share its cores: each task's intra-op pool (the threads one op is split over) gets
its share instead of TensorFlow's default of every core in every task: a worker ``cores // workers on the
machine`` (they compute at the same time), a ps ``cores // tasks on the machine`` (its updates are small), at
least 1. With 1 ps and 2 workers on 2 cores, two-thread pools in every task split each op across threads that
then waited for the other tasks' (``bench/threads.py``: the digits MLP's async-ps 1.14x the steps/s, a small
CNN unchanged); a lone worker keeps every core.
``TF_NUM_INTRAOP_THREADS`` in the engines' environment (``wb.Cluster(env=...)``) is TensorFlow's own setting and
wins: the workbench then leaves the pools' size to it.

Imports TensorFlow only inside ``apply_to_context``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ...compat import tensorflow as tf_compat
from ...errors import ConfigurationError

SPINNING_ENV = "WORKBENCH_THREAD_SPINNING"
INTRA_OP_ENV = "TF_NUM_INTRAOP_THREADS"  # TensorFlow's: when set, it sizes every intra-op pool itself
_SHARE = {"intra_op": 0}  # this process's intra-op threads (``share_cores``); 0: TensorFlow's choice
_YES, _NO = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def spinning(environ: Mapping[str, str] | None = None) -> bool:
    """Whether TensorFlow's pools keep their default spinning (``WORKBENCH_THREAD_SPINNING=1``); a value that is
    neither yes nor no raises ``ConfigurationError``."""
    environ = os.environ if environ is None else environ
    value = environ.get(SPINNING_ENV, "0").strip().lower()
    if value not in _YES + _NO:
        raise ConfigurationError(
            f"{SPINNING_ENV}={environ[SPINNING_ENV]!r} is not understood: set it to 1 to keep TensorFlow's spinning "
            "thread pools, or to 0 (the default) to have them sleep when out of work, then start the cluster again.")
    return value in _YES


def intra_op_share(sharing: int, environ: Mapping[str, str] | None = None, cores: int | None = None) -> int:
    """The intra-op threads of a task that shares the machine's ``cores`` (None: the ones this process may run
    on) with ``sharing`` tasks, itself included: its share, at least 1; 0 (TensorFlow's choice) when the
    environment sets ``TF_NUM_INTRAOP_THREADS``."""
    environ = os.environ if environ is None else environ
    if environ.get(INTRA_OP_ENV, "").strip():
        return 0
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return max(1, cores // max(1, sharing))


def share_cores(sharing: int, environ: Mapping[str, str] | None = None) -> int:
    """Make this process's pools made from now on (its server's, an all-reduce group's) take its share of the
    machine's cores among ``sharing`` tasks (``intra_op_share``); returns the threads (0: TensorFlow's choice)."""
    _SHARE["intra_op"] = intra_op_share(sharing, environ)
    return _SHARE["intra_op"]


def apply(config: Any, environ: Mapping[str, str] | None = None) -> Any:
    """Set ``config`` (a ``ConfigProto``) to this process's choice of spinning and, where ``share_cores`` chose
    one and ``config`` names none, its intra-op threads; returns it."""
    config.experimental.disable_thread_spinning = not spinning(environ)
    if _SHARE["intra_op"] and not config.intra_op_parallelism_threads:
        config.intra_op_parallelism_threads = _SHARE["intra_op"]
    return config


def apply_to_context(context: Any = None, environ: Mapping[str, str] | None = None) -> None:
    """Make the config that ``context`` (TensorFlow's eager context; None: this process's) hands to the tasks it
    connects to carry the choice. Called before the connection is made.

    TensorFlow builds a connection's ``ServerDef.default_session_config`` from the context's config, and each task
    sets up the pools of the remote context it makes for this process from it. The context keeps the config given
    at its creation in ``_config`` (usually none); the user's fields there are kept.
    """
    from tensorflow.core.protobuf import config_pb2

    context = tf_compat.eager_context() if context is None else context
    config = config_pb2.ConfigProto()
    given = tf_compat.context_config(context)
    if given is not None:
        config.CopyFrom(given)
    tf_compat.set_context_config(context, apply(config, environ))
