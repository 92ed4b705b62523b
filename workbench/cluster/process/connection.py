"""The notebook kernel as a TensorFlow client of one cluster at a time.

TensorFlow keeps one cluster connection per process. Connecting to a second cluster makes every
variable and function of the first unusable, and mixing connection modes in one process has
crashed it (a segmentation fault kills the kernel). So the workbench connects the kernel once per
cluster, through ``connect()``, and objects made under a connection record its epoch: using one
after the kernel moved to another cluster raises a clear error instead.

What TensorFlow made under a connection must be freed before the connection is replaced: freed
afterwards, its deleter runs against devices that no longer exist, and when the garbage collector
did that during another thread's tracing it crashed the kernel (segmentation fault). Objects that
hold such state (jobs) register with ``connect(..., holder=)``; before the next connection they are
asked to let go of it, and what is already garbage is collected while the old connection stands.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import threading
import time
import warnings
import weakref

from ... import native_logs
from ...compat import tensorflow as tf_compat
from ...errors import ClusterStateError, ExposedPortsWarning
from ..machine import memory, threads
from . import bind_hook, client_files, containment, reach

_LOCK = threading.Lock()
_STATE = {"spec": None, "cluster": None, "epoch": 0}
_PREPARED_LOCK = threading.Lock()
_HOLDERS: weakref.WeakSet = weakref.WeakSet()  # what holds TensorFlow state made under the current connection
SETTLE_SECONDS = 30.0  # how long a holder whose cluster stopped gets to finish (a job failing over its lost tasks)
LINK_RETRY_SECONDS = 0.1
# How long a connection update keeps trying a task it cannot reach. A re-hosted task's new server is reached
# once this process's gRPC reconnect back-off ends (TensorFlow caps it at a second); a task that is down
# (killed, its re-hosting yet to come) is not reached by waiting longer.
RECONNECT_SECONDS = 10.0
# How this process talks to the tasks, set before its first connection (TensorFlow reads them then).
# ParameterServerStrategy's own two settings: one outstanding request per task and no global executor
# syncs, so that a lost task's error stays with the calls made to it, instead of failing (or blocking
# forever) the next op of every thread; and fail fast: a call to a task that is down fails at once,
# rather than waiting for it to come back. A user's own setting of any of them wins.
CLIENT_ENVIRONMENT = {"TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE": "False", "TF_PS_DISABLE_ASYNC_EXECUTOR_GLOBALLY": "True",
                      "GRPC_FAIL_FAST": "true"}


def connect_problem(address: str, timeout: float) -> str:
    """``""`` when a TCP connection to ``address`` (``host:port``, ``[v6]:port``) opens within ``timeout`` s,
    else why not (the OS's words). It proves the task's server listens and its host is reachable."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return ""
    except OSError as exc:
        return str(exc) or type(exc).__name__


def connect(cluster, timeout: float = 60.0, holder=None) -> int:
    """Make this process a TF client of ``cluster`` (idempotent); return the connection epoch.

    ``holder`` (optional) will hold TensorFlow state made under this connection: it has
    ``settle(timeout) -> str | None`` (wait up to ``timeout`` s until it no longer runs; else say
    what runs) and ``release_remote()`` (let go of that state), called before the kernel connects
    elsewhere.
    """
    import tensorflow as tf

    if cluster.state != "running":
        raise ClusterStateError(
            f"cannot connect to cluster {cluster.name!r}: it is {cluster.state}. Start it first (cluster.start())."
        )
    spec = cluster.spec_dict
    for name in _take_deferred(cluster, spec):
        refresh(cluster, name, timeout)
    with _LOCK:
        if _STATE["spec"] == spec or _resize_locked(cluster, spec, time.monotonic() + timeout):
            _hold(holder)
            return _STATE["epoch"]
        _STATE.pop("deferred", None)
        if _STATE.get("broken"):
            raise ClusterStateError(_STATE["broken"])
        _refuse_other_strategies()
        _let_go(cluster.name)
        if _STATE["epoch"] == 0:
            prepare_process()
        for name, value in CLIENT_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
        # TensorFlow adds this process to the cluster as "localhost:<port>": no other host ever connects to
        # it, so with the bind shim loaded (Jupyter started by `make lab` or on Binder) it listens on loopback.
        before = set(containment.listeners())
        unprotected = bind_hook.protect_or_reason()  # however this process was started (no LD_PRELOAD needed)
        native_logs.route_to(cluster.log_path, f"kernel pid {os.getpid()} connects to cluster {cluster.name!r}")
        client_files.adopt_autograph()  # what this client's traces write goes where a killed kernel's is found
        client_files.sweep()
        _connect_with_timeout(tf, spec, cluster.name, timeout)
        _warn_if_exposed(sorted(set(containment.listeners()) - before), unprotected)
        _STATE.update(spec=spec, cluster=cluster.name, cluster_object=cluster, epoch=_STATE["epoch"] + 1)
        _hold(holder)
        return _STATE["epoch"]


def resize(cluster, leaving: tuple[str, ...] = (), timeout: float = 60.0) -> bool:
    """The cluster's worker tasks changed (``cluster.scale``): update this process's connection in place.

    Workers added since the connection join it, and those named in ``leaving`` (the highest indices, as ``scale``
    removes them) leave it, with TensorFlow's ``update_server_def``: what this process made on the other tasks (the ps
    tasks' variables, a job's functions) stays valid, as after a re-hosting. Call it with no remote op in flight (a job
    does, at a step boundary). Returns False, doing nothing, when this process is not connected to ``cluster`` or more
    than the workers changed (the next ``connect()`` then connects anew), or when a task does not answer (one lost, its
    re-hosting yet to come: the re-hosting, or the next ``connect()``, updates the connection to the cluster's tasks).
    """
    spec = cluster.spec_dict
    if leaving:
        spec = {**spec, "worker": [r.address for r in cluster.tasks if r.job == "worker" and r.name not in leaving]}
    with _LOCK:
        try:
            return _STATE.get("spec") == spec or _resize_locked(cluster, spec, time.monotonic() + timeout)
        except ClusterStateError as exc:
            import tensorflow as tf  # loaded: the connection it failed to update is TensorFlow's

            down = isinstance(exc, TaskUnreachable) or isinstance(exc.__cause__, tf.errors.UnavailableError)
            if not down or _STATE.get("broken"):
                raise
            return False  # a task is down: its health monitor and re-hosting say so, and bring the connection along


def _resize_locked(cluster, spec: dict, deadline: float) -> bool:
    """``resize`` with ``_LOCK`` held: the connected spec grows or shrinks to ``spec`` if only its workers differ."""
    connected = _STATE.get("spec")
    if _STATE.get("cluster_object") is not cluster or not connected or _STATE.get("broken"):
        return False
    old, new = connected.get("worker", []), spec.get("worker", [])
    kept = min(len(old), len(new))
    if {j: a for j, a in connected.items() if j != "worker"} != {j: a for j, a in spec.items() if j != "worker"} \
            or old[:kept] != new[:kept] or not new:
        return False
    _apply_spec(spec, deadline, f"telling this kernel that cluster {cluster.name!r} now has {len(new)} worker task(s)")
    return True


class TaskUnreachable(ClusterStateError):
    """A connection update found a task that does not accept connections (down, its re-hosting yet to come)."""


def _apply_spec(spec: dict, deadline: float, what: str) -> None:
    """Point this process's connection at ``spec``'s addresses in place (``update_server_def``); ``_LOCK`` held.

    Every task must accept a connection first: TensorFlow's update that fails on a task that is down leaves
    the connection without that task's devices ("unknown device" at the next op placed there).
    """
    for address in (a for job in spec.values() for a in job):
        problem = connect_problem(address, timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        if problem:
            raise TaskUnreachable(f"{what} was put off: the task at {address} does not answer ({problem}).")
    context = tf_compat.eager_context()
    server_def = type(context.get_server_def())()
    server_def.CopyFrom(context.get_server_def())
    for job in server_def.cluster.job:
        if job.name in spec:  # not this process's own job ("localhost")
            job.tasks.clear()
            for index, address in enumerate(spec[job.name]):
                job.tasks[index] = address
    try:
        bounded(lambda: _update_server_def(context, server_def, deadline), max(1.0, deadline - time.monotonic()), what)
    except ClusterStateError as exc:  # TensorFlow removes a task it cannot reach, then adds it back: did that fail?
        known = set() if _STATE.get("broken") else tf_compat.connected_tasks(context)
        missing = [f"{job}:{i}" for job, addresses in spec.items() for i in range(len(addresses))
                   if f"/job:{job}/replica:0/task:{i}" not in known] if known else []
        if missing:
            exc.args = (f"{exc.args[0]} This kernel's connection is left without the devices of {', '.join(missing)}: an op "
                        "placed there fails ('unknown device') until its next update (a re-hosting, a scale, the next job).",)
        raise
    _STATE["spec"] = spec


def hold(holder) -> None:
    """``holder`` (as ``connect(holder=)`` takes one) holds TensorFlow state made under the current connection."""
    with _LOCK:
        _hold(holder)


def _hold(holder) -> None:
    if holder is not None:
        _HOLDERS.add(holder)


def _let_go(name: str) -> None:
    """Before a new connection: refuse while a holder still runs; else free what the current one made."""
    if _STATE["spec"] is None:
        return  # the first connection: nothing to free (and no collection added to start-up)
    holders = list(_HOLDERS)
    old = _STATE.get("cluster_object")
    grace = 0.0 if old is not None and old.state == "running" else SETTLE_SECONDS  # a stopped cluster's jobs are ending
    deadline = time.monotonic() + grace  # one grace for all of them, not one each
    running = [what for what in (h.settle(max(0.0, deadline - time.monotonic())) for h in holders) if what]
    if running:
        raise ClusterStateError(
            f"cannot connect this kernel to cluster {name!r} while {', '.join(running)} on cluster {_STATE['cluster']!r}: "
            "the kernel holds one cluster connection at a time, and a new one (another cluster, or this one after "
            "scale()) ends what runs on the old. Wait for it (job.wait()) or stop it (job.stop()), then try again.")
    for holder in holders:
        holder.release_remote()
    _HOLDERS.clear()
    gc.collect()


def prepare_process() -> None:
    """Once per process, before its first connection and once TensorFlow is imported (``Cluster.start`` and
    ``wb.train`` call it, where their caller waits anyway; the first connection does otherwise, in a job's thread).

    What this process holds now (TensorFlow's and Keras's modules, the user's imports) lives as long as it does,
    so the garbage collector stops scanning it: a full collection then takes milliseconds instead of about 0.3 s
    with the GIL held (the collection that finds the garbage before freezing costs that once, so it is made here,
    not in a thread while the user's cell has returned). And a freed function leaves the tasks without the GIL, and
    no function is registered on the tasks while the connection changes (``compat.tensorflow.guard_context_changes``).
    """
    with _PREPARED_LOCK:
        if _STATE.get("prepared") or "tensorflow" not in sys.modules:
            return
        gc.collect()
        gc.freeze()
        tf_compat.guard_context_changes()
        _STATE["prepared"] = True


def free_garbage() -> None:
    """Collect what is garbage now, in the calling thread, and give the memory it held back to the system.

    A freed TensorFlow function is removed from every task, one RPC each with the GIL held, and the functions of a
    traced loop (``while`` bodies) sit in reference cycles that only the collector frees: collected here, at a
    moment chosen by the caller (a job's end, in its own thread), not wherever the collector runs next (a cell, a
    callback, while a task is blocked). The caller makes sure no task is silent: an RPC to it would block. Then what
    was freed goes back to the system (glibc keeps freed heap pages for reuse: a long-lived kernel's resident memory
    carried it from job to job; ``bench/soak.py``); the trim takes well under a millisecond.
    """
    gc.collect()
    memory.trim_memory()


def release(cluster) -> None:
    """``cluster`` is stopping: free what this process made on its tasks (variables, functions, datasets) now,
    while the tasks still answer, rather than later in the garbage collector against tasks that are gone (each
    then printed an ignored ``UnavailableError``). The holders keep what they need locally (``job.model``)."""
    with _LOCK:
        if _STATE.get("cluster_object") is not cluster:
            return
        holders = list(_HOLDERS)
        _HOLDERS.clear()
    for holder in holders:
        holder.release_remote()
    gc.collect()


def _warn_if_exposed(opened: list[tuple[str, int]], why: str = "") -> None:
    """Say, loudly and once per connection, that this kernel's new TensorFlow port is open to every network."""
    wide = containment.exposed(opened)
    if not wide or os.environ.get(containment.BIND_ENV) == containment.EVERY_INTERFACE:
        return
    ports = ", ".join(containment.describe(a) for a in wide)
    warnings.warn(
        f"this process's TensorFlow port ({ports}) listens on every network interface with no authentication: anyone "
        f"who can reach this machine can run code in it{f' (the workbench could not keep it on loopback: {why})' if why else ''}. "
        "Keep this machine's ports behind a firewall, or run where the workbench's bind shim works (Linux x86_64 or "
        "aarch64 with a C compiler).",
        ExposedPortsWarning, stacklevel=4)


def _connect_with_timeout(tf, spec: dict, name: str, timeout: float) -> None:
    """TensorFlow's connect has no timeout and waits for every task: a stalled one blocks it forever."""

    def run() -> None:
        threads.apply_to_context()
        _set_cluster(tf, spec, time.monotonic() + RECONNECT_SECONDS)
        # One tiny remote op: it proves the connection, and TensorFlow opens this process's own
        # port only then, so what it listens on can be checked now rather than at some later op.
        job = "worker" if "worker" in spec else sorted(spec)[0]
        touch(tf, f"/job:{job}/replica:0/task:0/device:CPU:0")

    bounded(run, timeout, f"connecting this kernel to cluster {name!r}")


def touch(tf, device: str) -> None:
    """One tiny op on ``device``, returning once its task answered. Its input is made here and copied inside the
    op, with the GIL released: made under the task's scope, it would be copied there holding the GIL."""
    zero = tf.constant(0)
    with tf.device(device):
        tf.identity(zero).numpy()


def _set_cluster(tf, spec: dict, deadline: float) -> None:
    """``connect_to_cluster``, tried again while a task that accepts connections is refused by this process's channel.

    gRPC keeps one channel per address in a process: a task that listens on a port an earlier task of this
    process used (a stopped cluster's) may find that channel still in reconnect back-off, which fails fast
    ("Connection refused" although the new server listens). The back-off ends within a second. A task that
    does not accept connections at all is not waited for.
    """
    _retrying(lambda: tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(spec)), deadline,
              down=lambda: any(connect_problem(a, timeout=1.0) for job in spec.values() for a in job))


def _retrying(change, deadline: float, before=None, down=None) -> None:
    """``change()`` (a change of this process's connection), tried again while TensorFlow finds a task unavailable,
    until ``deadline``; ``before()`` runs before each try; ``down()`` True (a task accepts no connection) stops them."""
    import tensorflow as tf

    while True:
        if before is not None:
            before()
        try:
            with tf_compat.context_change():  # not while a freed function is being removed from the tasks
                change()
            return
        except tf.errors.UnavailableError:
            if (down is not None and down()) or time.monotonic() + LINK_RETRY_SECONDS * 2 > deadline:
                raise
            time.sleep(LINK_RETRY_SECONDS * 2)


def bounded(work, timeout: float, what: str, breaks: bool = True) -> None:
    """Run ``work()`` in a thread for at most ``timeout`` s. TensorFlow cannot cancel what runs past it: when
    ``work`` changes the connection (``breaks``), the connection is then marked broken (every later use says
    why) rather than left half-changed; otherwise the work goes on in its thread and ``TimeoutError`` is raised."""
    outcome: dict = {}

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="workbench-connect", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive() and not breaks:
        raise TimeoutError(f"{what} did not finish within {timeout:.0f} s")
    if thread.is_alive():
        _STATE["broken"] = (
            f"{what} did not finish within {timeout:.0f} s: a task is not answering (stopped, overloaded, or behind "
            "a firewall; see cluster.status()). TensorFlow cannot cancel the attempt, so restart the kernel before "
            "connecting again." + native_logs.hint()
        )
        raise ClusterStateError(_STATE["broken"])
    if "error" in outcome:
        raise ClusterStateError(f"{what} failed: {outcome['error']}.{native_logs.hint()}") from outcome["error"]


def defer_refresh(cluster, rehosted: str) -> None:
    """Task ``rehosted`` runs on a new server, and what re-hosted it does not use this process's connection (an
    all-reduce group runs on the engines): the next ``connect()`` updates the connection (``refresh``)."""
    with _LOCK:
        if _STATE.get("cluster_object") is cluster:
            _STATE.setdefault("deferred", set()).add(rehosted)


def _take_deferred(cluster, spec: dict) -> list[str]:
    with _LOCK:
        if _STATE.get("cluster_object") is not cluster or _STATE["spec"] != spec:
            return []
        return sorted(_STATE.pop("deferred", ()))


def refresh(cluster, rehosted: str, timeout: float = 60.0) -> bool:
    """Task ``rehosted`` of ``cluster`` runs on a new server: update this process's connection in place.

    What ClusterCoordinator does when a worker comes back (``update_server_def``): TensorFlow makes a
    new context on the new server, and what this process made on the other tasks (variables,
    functions, datasets) stays valid. Then waits until the new server and every other task reach
    each other. A change of the workers that this connection could not follow yet (a scale while the
    task was down) is followed too. Returns False, doing nothing, when this process is not connected to
    ``cluster`` or more than its workers changed since (the next ``connect()`` connects anew).
    """
    deadline = time.monotonic() + timeout
    with _LOCK:
        spec = cluster.spec_dict
        connected = _STATE.get("spec") or {}
        if _STATE.get("cluster_object") is not cluster or not spec.get("worker") or {
                j: len(a) for j, a in connected.items() if j != "worker"} != {j: len(a) for j, a in spec.items() if j != "worker"}:
            return False
        if _STATE.get("broken"):
            raise ClusterStateError(_STATE["broken"])
        _apply_spec(spec, deadline, f"telling this kernel that {rehosted} of cluster {cluster.name!r} was re-hosted")
        _STATE.get("deferred", set()).discard(rehosted)
    reach.await_links(cluster, rehosted, deadline, LINK_RETRY_SECONDS)
    return True


def _update_server_def(ctx, server_def, deadline: float) -> None:
    """``update_server_def``, tried again while the new server is unreachable from here.

    This process called the old server when it went away, so its gRPC channel to that address is in
    reconnect back-off, and fails fast (``GRPC_FAIL_FAST``) until the back-off ends (TensorFlow caps it
    at a second). Tried for ``RECONNECT_SECONDS`` at most: a task that is down does not come back by
    waiting (a scale that found a task just killed waited out the whole start timeout, and the task's
    re-hosting, which waited for the scale, with it).
    """
    deadline = min(deadline, time.monotonic() + RECONNECT_SECONDS)
    _retrying(lambda: ctx.update_server_def(server_def), deadline,
              before=lambda: _await_channels(ctx, server_def, deadline))


def _await_channels(ctx, server_def, deadline: float) -> None:
    """Wait until this process's own channel reaches every task the update keeps (``check_alive``, TensorFlow's
    status call over that channel), until ``deadline``; the update then reports what it finds.

    A task's new server may accept connections while the channel to its address is still in back-off and fails
    fast. An update that fails that way is not harmless: under load, after one, the ps tasks no longer knew
    tensors this process had made there (the next step failed: "Unable to find the relevant tensor
    remote_handle"). The channel's back-off ends within a second.
    """
    import tensorflow as tf

    current = {(job.name, index) for job in ctx.get_server_def().cluster.job for index in job.tasks}
    kept = [f"/job:{job.name}/replica:0/task:{index}" for job in server_def.cluster.job for index in job.tasks
            if (job.name, index) in current and job.name != server_def.job_name]
    for name in kept:
        while True:
            try:
                if ctx.check_alive(name):
                    break
            except (tf.errors.UnavailableError, tf.errors.InvalidArgumentError):
                pass
            if time.monotonic() + LINK_RETRY_SECONDS > deadline:
                return
            time.sleep(LINK_RETRY_SECONDS)


def check_epoch(epoch: int, what: str) -> None:
    """Raise if ``what`` was made under a connection the kernel has since replaced."""
    if epoch != _STATE["epoch"]:
        raise ClusterStateError(
            f"{what} belongs to a cluster connection this kernel has replaced (it now talks to "
            f"{_STATE['cluster']!r}); its variables are out of reach. Re-run the job on the current cluster, "
            "or use job.model, the local copy of the trained weights."
        )


def current_epoch() -> int:
    return _STATE["epoch"]


def current_cluster():
    """The cluster this process is connected to, if it is still running; else None."""
    cluster = _STATE.get("cluster_object")
    return cluster if cluster is not None and cluster.state == "running" else None


def _refuse_other_strategies() -> None:
    import tensorflow as tf

    if tf.distribute.has_strategy():
        raise ClusterStateError(
            f"a tf.distribute strategy ({type(tf.distribute.get_strategy()).__name__}) is active in this kernel; "
            "connecting it to a cluster as well has crashed TensorFlow. Leave the strategy's scope, or run that "
            "code in another kernel."
        )
