"""Engines the workbench borrows and never stops: those of an ipyparallel cluster the user runs
(``Cluster.from_existing``), or of a workbench cluster that another process owns (``Cluster.attach``).

``AttachedPool`` answers what ``OwnedPool`` does, so the cluster uses either the same way.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import psutil

from ...errors import ClusterStartError, ClusterStateError, ConfigurationError
from ..machine.processes import find_process
from .calls import Deadline
from .pool import POLL_SECONDS


class AttachedPool:
    """Engines of an ipyparallel cluster the user runs; the workbench never stops them."""

    owned = False
    lifeline = ""

    def __init__(self, client: Any, *, close_client: bool, launcher: str = "existing", cluster: Any = None):
        self.client = client
        self.launcher = launcher
        self._close_client = close_client
        self._cluster = cluster
        self.name = getattr(cluster, "cluster_id", "") or ""
        self.controller_ip = getattr(cluster, "controller_ip", "") or "127.0.0.1"

    def watch(self, pids: Iterable[int]) -> None:
        pass

    def process(self, pid: int) -> psutil.Process | None:
        """The local process ``pid`` if it still runs (a borrowed engine's: started elsewhere, not watched here)."""
        return find_process(pid)

    def remove_on_death(self, path: str) -> None:
        pass

    controller_pids: list[int] = []

    def health_reports(self) -> Iterator[dict]:
        """Borrowed engines hold no lifeline to this client: their health is read from the controller (``status()``)."""
        return iter(())

    def start(self, deadline: Deadline) -> None:
        pass

    def add_engines(self, n: int, deadline: Deadline, on_progress, exclude: Iterable[int] = ()) -> list[int]:
        """Take ``n`` idle engines, waiting until enough registered."""
        taken = set(exclude)
        while True:
            idle = sorted(set(self.client.ids) - taken)
            on_progress(min(len(idle), n), n)
            if len(idle) >= n:
                return idle[:n]
            if deadline.expired:
                raise ClusterStateError(
                    f"the attached ipyparallel cluster has {len(idle)} idle engine(s) but {n} are needed; "
                    "start more engines there (e.g. `ipcluster engines -n N` or cluster.start_engines_sync(N)) "
                    "or ask for fewer tasks."
                )
            time.sleep(POLL_SECONDS)

    def remove_engines(self, engine_ids: list[int], pids: list[int], deadline: Deadline) -> None:
        from . import engine_side

        if engine_ids:
            self.client[engine_ids].apply_async(engine_side.release).get(timeout=deadline.remaining(1))

    def close(self, timeout: float = 60.0) -> None:
        if self._close_client and self.client is not None:
            self.client.close()
        self.client = None

    cluster_file = ""
    profile_dir = ""


def attach_client(source: Any, profile: str | None, cluster_id: str | None, timeout: float) -> tuple[Any, bool, Any]:
    """An ipyparallel ``Client`` for ``from_existing``: (client, we_created_it, ipp_cluster_or_None)."""
    import ipyparallel as ipp

    if isinstance(source, ipp.Client):
        return source, False, getattr(source, "cluster", None)
    if isinstance(source, ipp.Cluster):
        return source.connect_client_sync(), True, source
    if source is not None:
        raise ConfigurationError(
            f"cannot attach to {type(source).__name__}: pass an ipyparallel.Cluster, an ipyparallel.Client, "
            "or profile=/cluster_id= of a running ipyparallel cluster."
        )
    kwargs = {}
    if profile:
        kwargs["profile"] = profile
    if cluster_id is not None:
        kwargs["cluster_id"] = cluster_id
    try:
        return ipp.Client(timeout=timeout, **kwargs), True, None
    except (OSError, TimeoutError) as exc:
        raise ClusterStartError(
            f"could not connect to an ipyparallel cluster (profile={profile!r}, cluster_id={cluster_id!r}): {exc}. "
            "Start one first (`ipcluster start -n N`) or pass the ipyparallel.Cluster object."
        ) from exc
