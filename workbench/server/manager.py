"""What the panel manages, as plain Python (no web framework): tested on its own, wrapped by handlers."""

from __future__ import annotations

import re

from ..cluster import registry
from ..errors import WorkbenchError
from .models import ClusterInfo

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class BadRequest(WorkbenchError):
    """The request itself is wrong (answered with 400)."""


class NotFound(WorkbenchError):
    """No such cluster (answered with 404)."""


class ClusterManager:
    """The clusters running on this machine, from the registry every ``Cluster`` writes."""

    def clusters(self) -> list[ClusterInfo]:
        """Every cluster whose owner (a kernel, a terminal, a script) is alive, by name."""
        return [ClusterInfo.from_record(r) for r in registry.list_clusters()]

    def cluster(self, name: str) -> ClusterInfo:
        if not _NAME_RE.match(name or ""):
            raise BadRequest(f"{name!r} is not a cluster name: names are letters, digits, '.', '_' and '-' (at most 64).")
        for info in self.clusters():
            if info.name == name:
                return info
        known = ", ".join(c.name for c in self.clusters()) or "none"
        raise NotFound(f"no running cluster named {name!r} (running: {known}); start one with wb.Cluster(...).start().")
