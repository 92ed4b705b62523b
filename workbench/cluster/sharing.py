"""What a cluster shares beyond the code that started it.

- With the layers above it in this process: resources they keep until the cluster stops
  (``cluster.keep``: the control endpoint, dashboards, widgets).
- With other processes: its registry record (tasks, states, and the endpoints it serves, which
  ``cluster.advertise`` adds), and the view another process gets of it: ``attach`` (a cluster
  that another process runs) and ``borrow`` (engines of an ipyparallel cluster the user runs,
  behind ``Cluster.from_existing``).

``Shared`` is held by the cluster as ``cluster.shared``; the two constructors return a ``Cluster``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from ..errors import ClusterStartError, ClusterStateError
from ..telemetry.forwarding import TelemetryForwarder
from . import registry
from .launch.borrowed import AttachedPool, attach_client
from .machine.versions import client_tensorflow_version, workbench_version
from .registry import ClusterRecord, Endpoint


class Shared:
    """The resources kept with a cluster and the registry record that publishes it."""

    def __init__(self, cluster):
        self.cluster = cluster
        self._kept: dict[str, tuple[Any, Callable[[], None] | None]] = {}  # key -> (resource, close)
        self.endpoints: dict[str, Endpoint] = {}  # what this process serves for other processes, in the record
        self._record_lock = threading.Lock()  # one writer at a time: a job's thread, the kernel, the control thread
        self._removed = False  # the cluster stopped: nothing writes its record again

    def keep(self, key: str, resource: Any, close: Callable[[], None] | None = None) -> Any:
        """Hold ``resource`` (a server, a widget, ...) under ``key`` until this cluster stops, then call ``close``.

        For the layers above the engine pool (control endpoint, dashboards): what they start for a
        cluster ends with it. Keeping a new resource under a key in use closes the old one first.
        """
        self.release(key, close=True)
        self._kept[key] = (resource, close)
        return resource

    def kept(self, key: str, default: Any = None) -> Any:
        """The resource kept under ``key``, or ``default``."""
        entry = self._kept.get(key)
        return entry[0] if entry is not None else default

    def release(self, key: str, close: bool = False) -> Any:
        """Stop holding the resource under ``key`` (closing it if ``close``); returns it, or None."""
        resource, closer = self._kept.pop(key, (None, None))
        if close and closer is not None:
            closer()
        return resource

    def advertise(self, name: str, endpoint: Endpoint | None) -> None:
        """Publish (or with ``None`` withdraw) what this process serves for the cluster, in its registry record."""
        if endpoint is None:
            self.endpoints.pop(name, None)
        else:
            self.endpoints[name] = endpoint
        if self.cluster.state == "running":
            self.write_record()

    def close_all(self) -> None:
        """Close what higher layers kept, newest first; one that fails does not stop the others."""
        while self._kept:
            key = next(reversed(self._kept))
            try:
                self.release(key, close=True)
            except Exception:  # noqa: BLE001 - stopping must go on; the resource is gone with the cluster anyway
                pass
        self.endpoints.clear()

    def remove_record(self) -> None:
        """The cluster stopped (or failed to start): its record goes, and no late writer brings it back."""
        with self._record_lock:
            self._removed = True
            if not self.cluster.attached:  # an attached process only ends its own connection; the owner keeps it
                registry.remove_record(self.cluster.name)

    def write_record(self) -> None:
        """The cluster's registry record, as it is now (read by the panel and by attached processes)."""
        with self._record_lock:
            if not self.cluster.attached and not self._removed:  # the owner's record stays the owner's
                self._write_record()

    def _write_record(self) -> None:
        cluster = self.cluster
        pool = cluster.pool
        proc = psutil.Process()
        registry.write_record(ClusterRecord(
            name=cluster.name,
            state=cluster.state,
            engines=cluster.launcher,
            owned=bool(pool and pool.owned),
            client_pid=proc.pid,
            client_created=proc.create_time(),
            cluster_file=pool.cluster_file if pool else "",
            profile_dir=pool.profile_dir if pool else "",
            spec=cluster.spec_dict,
            tasks=cluster.tasks,
            gpus_per_worker=cluster.gpus_per_worker,
            endpoints=dict(self.endpoints),
            network=cluster.network,
            updated=time.time(),
            workbench_version=workbench_version(),
            job=getattr(cluster.job_queue.current, "name", ""),
        ))


def attach(cls: type, name: str, timeout: float):
    """Use, from this process, a cluster that another one runs (a notebook kernel, the Workbench panel).

    The attached object trains, places ops, profiles and shows dashboards like the owner's.
    It does not own the cluster: ``stop()`` only disconnects this process, and scaling or
    stopping the cluster is done by its owner (or from the Workbench panel).
    """
    import ipyparallel as ipp

    deadline = time.monotonic() + timeout
    while True:  # a cluster still starting is waited for (its record says "starting" until its servers are up)
        records = {r.name: r for r in registry.list_clusters()}
        record = records.get(name)
        if record is None or record.state != "starting" or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if record is None:
        running = ", ".join(records) or "none"
        raise ClusterStateError(f"no running cluster named {name!r} on this machine (running: {running}). Start "
                                "one with wb.Cluster(...).start() or from the Workbench panel.")
    if record.state != "running":
        raise ClusterStateError(f"cluster {name!r} is {record.state} (owner pid {record.client_pid}), not running after "
                                f"{timeout:.0f} s: attach once it runs, or pass a longer timeout=.")
    if record.client_pid == os.getpid():
        raise ClusterStateError(f"cluster {name!r} runs in this very process: use that object "
                                f"(wb.running_clusters() lists it).")
    if not record.cluster_file:
        raise ClusterStateError(f"cluster {name!r} borrows the engines of an ipyparallel cluster it does not own: "
                                "connect to that one with wb.Cluster.from_existing(...) instead.")
    cluster = cls(len(record.spec.get("ps", [])), len(record.spec.get("worker", [])), engines=None, name=name,
                  progress=False)
    try:
        client = ipp.Cluster.from_file(record.cluster_file).connect_client_sync(timeout=timeout)
    except (OSError, TimeoutError, ValueError) as exc:
        raise ClusterStateError(f"could not connect to cluster {name!r}'s controller ({exc}); its owner (pid "
                                f"{record.client_pid}) may be stopping it.") from None
    cluster.launcher = record.engines
    cluster.owner_pid = record.client_pid
    cluster.pool = AttachedPool(client, close_client=True, launcher=cluster.launcher)
    cluster.records = {r.task: r for r in record.tasks}
    cluster.client_tf_version = client_tensorflow_version()
    cluster.mark_running()
    # this process's jobs go to the owner's telemetry too: its dashboards and the panel show them
    forwarder = TelemetryForwarder(name, cluster.telemetry, lambda: registry.endpoint(name, "control")).start()
    cluster.keep("telemetry-forwarder", forwarder, close=forwarder.stop)
    return cluster


def refuse_a_running_name(name: str) -> None:
    """A second cluster of a running one's name would share its registry record and ipyparallel files."""
    record = registry.read_record(name)
    if record is not None and record.client_alive():
        raise ClusterStartError(
            f"a cluster named {name!r} is already running (owned by process {record.client_pid}): "
            f"give this one another name, e.g. wb.Cluster(..., name={name + '-2'!r}), or stop that one first."
        )


def borrow(cls: type, source: Any, ps: int, workers: int, profile: str | None, cluster_id: str | None, **options: Any):
    """Give TF roles to the engines of an ipyparallel cluster the user already runs.

    ``source`` is an ``ipyparallel.Cluster`` or ``ipyparallel.Client``; or leave it out and
    name the cluster with ``profile=``/``cluster_id=``. Call ``start()`` next. ``stop()`` then
    releases the roles and leaves the engines running (their TF servers keep listening until
    the engines restart: TensorFlow cannot stop a server inside a running process).
    """
    cluster = cls(ps, workers, engines=None, **options)
    cluster.launcher = "existing"

    def factory() -> AttachedPool:
        client, created, ipp_cluster = attach_client(source, profile, cluster_id, cluster.start_timeout)
        return AttachedPool(client, close_client=created, cluster=ipp_cluster)

    cluster.pool_factory = factory
    return cluster
