"""What the panel manages, as plain Python (no web framework): tested on its own, wrapped by handlers.

Clusters are listed from the registry every ``Cluster`` writes. Acting on one (scale, stop, serve
its dashboards) goes to its owner, the process that started it (a notebook kernel, a script, or
this Jupyter server for clusters started from the panel), through the owner's control endpoint
(``workbench.control``). Methods block; the handlers run them on a thread.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
import urllib.error
from typing import Any

import psutil

from ..cluster import registry
from ..cluster.registry import ClusterRecord
from ..cluster.spec import validate_name
from ..errors import ConfigurationError, WorkbenchError
from .models import ClusterInfo, JobNow, PlotLink, StartForm

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
CONTROL_TIMEOUT = 15.0  # one call to an owner (scaling waits for engines: see SCALE_TIMEOUT)
SCALE_TIMEOUT = 300.0
STOP_TIMEOUT = 90.0


class BadRequest(WorkbenchError):
    """The request itself is wrong (answered with 400)."""


class NotFound(WorkbenchError):
    """No such cluster (answered with 404)."""


class OwnerError(WorkbenchError):
    """The cluster's owner refused or failed the operation (answered with 409, its message passed on)."""


class ClusterManager:
    """The clusters running on this machine; the ones started from the panel are owned here."""

    def __init__(self) -> None:
        self._owned: dict[str, Any] = {}  # name -> Cluster started from the panel (this process owns it)
        self._starting: set[str] = set()
        self._lock = threading.Lock()
        self._upstreams: dict[tuple[str, str], tuple[str, str]] = {}  # (name, prefix) -> (owner, dashboards URL)

    # -- reading ------------------------------------------------------------------------------

    def clusters(self) -> list[ClusterInfo]:
        """Every cluster whose owner (a kernel, a terminal, a script, this server) is alive, by name."""
        return [self._info(r) for r in registry.list_clusters()]

    def listing(self) -> dict[str, Any]:
        """``clusters()`` as the panel reads them, with a ``version``: the same version, nothing new to draw."""
        clusters = [c.to_json() for c in self.clusters()]
        return {"clusters": clusters, "version": hashlib.sha1(json.dumps(clusters, sort_keys=True).encode()).hexdigest()[:16]}

    def cluster(self, name: str) -> ClusterInfo:
        return self._info(self._record(name))

    def _info(self, record: ClusterRecord) -> ClusterInfo:
        """The record as the panel shows it, with the health of each task on this host checked now.

        The owner writes its record when the cluster starts or scales; an engine that died since
        shows here as "lost" (its process is gone), without asking the owner.
        """
        from ..cluster.launch.pool import local_hostnames

        here = local_hostnames()
        for task in record.tasks:
            if task.state == "running" and task.host in here and not psutil.pid_exists(task.pid):
                task.state, task.note = "lost", "its process is gone"
        from_panel = record.name in self._owned or record.name in self._starting  # started (or starting) here
        return ClusterInfo.from_record(record, owned_here=from_panel)

    def summary(self, name: str) -> JobNow | None:
        """The newest job's progress and throughput now (``None`` before the first job)."""
        body = self._call(self._record(name), "GET", "summary")
        return JobNow.from_json(body) if body is not None else None

    def plots(self, name: str, proxy_prefix: str) -> list[PlotLink]:
        """The cluster's plots, served by its owner under ``proxy_prefix`` (the Jupyter server's proxy path)."""
        served = self._call(self._record(name), "POST", "dashboards", {"prefix": proxy_prefix})
        return [PlotLink(name=p["name"], title=p["title"], path=f"{proxy_prefix}/{p['name']}") for p in served["plots"]]

    def upstream(self, name: str, proxy_prefix: str) -> str:
        """Where the owner serves the dashboards of ``name`` for ``proxy_prefix`` (started on first use)."""
        record = self._record(name)
        owner = getattr(record.endpoints.get("control"), "url", None)
        cached = self._upstreams.get((name, proxy_prefix))
        if cached is not None and cached[0] == owner:
            return cached[1]
        url = self._call(record, "POST", "dashboards", {"prefix": proxy_prefix})["url"]
        self._upstreams[(name, proxy_prefix)] = (owner, url)
        return url

    def forget_upstream(self, name: str) -> None:
        """The proxy could not reach it: ask the owner again next time."""
        for key in [k for k in self._upstreams if k[0] == name]:
            self._upstreams.pop(key, None)

    # -- acting -------------------------------------------------------------------------------

    def start(self, form: dict) -> ClusterInfo:
        """Start a cluster owned by this server (it stops with the server, or from the panel)."""
        from ..cluster.cluster import Cluster

        try:
            spec = StartForm.parse(form)
        except ConfigurationError as exc:
            raise BadRequest(str(exc)) from None
        name = spec.name or validate_name(None)
        with self._lock:
            taken = {r.name for r in registry.list_clusters()} | set(self._owned) | self._starting
            if name in taken:
                raise BadRequest(f"a cluster named {name!r} is already running: choose another name.")
            self._starting.add(name)
        try:
            try:
                cluster = Cluster(spec.ps, spec.workers, engines=spec.engines, gpus_per_worker=spec.gpus_per_worker,
                                  name=name, progress=False, controller_ip=spec.controller_ip or None,
                                  **spec.launcher_options())
            except ConfigurationError as exc:
                raise BadRequest(str(exc)) from None
            cluster.start()  # its own errors say what failed; the handler passes them on
            self._owned[name] = cluster
        finally:
            self._starting.discard(name)
        return self.cluster(name)

    def scale(self, name: str, workers: Any) -> ClusterInfo:
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise BadRequest(f"workers={workers!r}: send the new number of worker tasks, an integer >= 1.")
        self._call(self._record(name), "POST", "scale", {"workers": workers}, timeout=SCALE_TIMEOUT)
        return self.cluster(name)

    def stop(self, name: str, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the cluster through its owner; return once its record is gone (the owner cleaned up)."""
        record = self._record(name)
        self._call(record, "POST", "stop")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not registry.registry_path(name).exists():
                self._owned.pop(name, None)
                return
            time.sleep(0.2)
        raise OwnerError(f"cluster {name!r} did not stop within {timeout:.0f} s; its owner (pid "
                         f"{record.client_pid}) may be busy. Try again, or stop it from that process.")

    def stop_owned(self) -> None:
        """Stop the clusters started from the panel (the server is shutting down)."""
        for cluster in list(self._owned.values()):
            cluster.stop()
        self._owned.clear()

    # -- helpers ------------------------------------------------------------------------------

    def _record(self, name: str) -> ClusterRecord:
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise BadRequest(f"{name!r} is not a cluster name: names are letters, digits, '.', '_' and '-' (at most 64).")
        records = registry.list_clusters()
        for record in records:
            if record.name == name:
                return record
        known = ", ".join(r.name for r in records) or "none"
        raise NotFound(f"no running cluster named {name!r} (running: {known}); start one from the panel or with "
                       "wb.Cluster(...).start().")

    def _call(self, record: ClusterRecord, method: str, op: str, body: dict | None = None,
              timeout: float = CONTROL_TIMEOUT) -> Any:
        control = record.endpoints.get("control")
        if control is None:
            raise OwnerError(f"cluster {record.name!r} was started by a workbench without a control endpoint "
                             f"(version {record.workbench_version or 'unknown'}): act on it from its owner "
                             f"(pid {record.client_pid}).")
        try:
            return control.request(method, op, body, timeout)
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read())["error"]
            except (ValueError, KeyError, TypeError):
                message = f"HTTP {exc.code}"
            if exc.code == 400:
                raise BadRequest(message) from None
            raise OwnerError(f"cluster {record.name!r}: {message}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            raise OwnerError(f"cluster {record.name!r}: its owner (pid {record.client_pid}) did not answer "
                             f"within {timeout:.0f} s ({reason}). It may be busy or stopping; try again.") from None
