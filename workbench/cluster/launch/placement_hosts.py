"""``hosts=`` (engines='ssh'): which hosts the next engines start on.

ipyparallel's SSH launcher fills the hosts of its ``engines`` map in order, from the first one, at
every start: a cluster's tasks would crowd the first host, and a task re-hosted after its host
failed would be started on that dead host again. So before each start the workbench hands the
launcher a map of its own: hosts whose SSH port answers, least used first (the tasks running there,
counted by the cluster), never more engines than a host's slots. A task re-hosted after its engine
alone was lost goes back to its own host (it has the most free slots once its task no longer counts),
and keeps its address; after its whole host was lost, it goes to another host.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

from ...errors import ClusterStartError, ConfigurationError

CONNECT_TIMEOUT = 3.0


def split(key: str) -> tuple[str, int]:
    """``user@host:port`` -> ``(host, port)``, the way ipyparallel reads its ``engines`` keys (port 22 if none)."""
    host = key.split("@", 1)[-1]
    name, _, port = host.partition(":")
    return name, int(port) if port.isdigit() else 22


def slots(count: Any) -> Any:
    """A host's number of engines: ``2``, or ``{"n": 2, ...}`` (ipyparallel's per-host overrides)."""
    return count.get("n", 1) if isinstance(count, Mapping) else count


def validate(launcher_cls: type, hosts: Any) -> dict[str, Any]:
    """``hosts=``: how many engines each host runs, for launchers that place engines by host name (engines='ssh').

    It is that launcher's own ``engines`` option, renamed: ``engines=`` names the launcher here.
    """
    if "engines" not in launcher_cls.class_trait_names(config=True):
        raise ConfigurationError(f"hosts= places engines on named hosts, which {launcher_cls.__name__} does not do: "
                                 "use it with engines='ssh' (or leave it out).")
    if not isinstance(hosts, Mapping) or not hosts:
        raise ConfigurationError(f"hosts={hosts!r} must map each host to its number of engines, e.g. "
                                 "hosts={'node1': 2, 'user@node2:2222': 1}.")
    for host, count in hosts.items():
        n = slots(count)
        if not isinstance(host, str) or not host or not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigurationError(f"hosts: {host!r}: {count!r} is not a number of engines (an int >= 1) for a host name.")
    return {host: dict(count) if isinstance(count, Mapping) else count for host, count in hosts.items()}


def reachable(key: str, timeout: float = CONNECT_TIMEOUT) -> str:
    """``""`` when ``key``'s SSH port accepts a connection, else why not."""
    host, port = split(key)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return ""
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def place(n: int, hosts: Mapping[str, Any], in_use: Mapping[str, int]) -> dict[str, Any]:
    """The ``engines`` map for ``n`` more engines: reachable hosts, least used first, within their slots.

    ``in_use`` counts running tasks by host name and by address (without port); a host is matched
    by either. Raises ``ClusterStartError`` naming every host and why it cannot take one when the
    reachable hosts have fewer free slots than ``n``.
    """
    free: dict[str, int] = {}
    why: dict[str, str] = {}
    for key, count in hosts.items():
        name = split(key)[0]
        left = slots(count) - in_use.get(name, 0)
        if left <= 0:
            why[key] = f"{slots(count)} of {slots(count)} slots used"
        elif problem := reachable(key):
            why[key] = f"unreachable ({problem})"
        else:
            free[key] = left
    chosen: dict[str, int] = {}
    for _ in range(n):
        candidates = [k for k in free if free[k] > 0]
        if not candidates:
            listed = "; ".join(f"{k}: {w}" for k, w in why.items()) or "none listed"
            raise ClusterStartError(
                f"no host can take {n - sum(chosen.values())} more engine(s) ({listed}). Add hosts, or slots to "
                "them, in hosts=, or bring back the hosts that do not answer, then try again.")
        key = max(candidates, key=lambda k: free[k])  # the first of the least used, in the order given
        free[key] -= 1
        chosen[key] = chosen.get(key, 0) + 1
    return {key: _with_count(hosts[key], k) for key, k in chosen.items()}


def _with_count(count: Any, n: int) -> Any:
    return {**count, "n": n} if isinstance(count, Mapping) else n


def one_command_per_host(chosen: Mapping[str, Any], environment: Mapping[str, str], forks_env: str) -> dict[str, Any]:
    """``{host: k}`` -> one engine command per host that becomes ``k`` engines (``forks_env`` tells it ``k``)."""
    commands = {}
    for key, count in chosen.items():
        overrides = dict(count) if isinstance(count, Mapping) else {}
        env = {**environment, **overrides.get("environment", {}), forks_env: str(slots(count))}
        commands[key] = {**overrides, "n": 1, "environment": env}
    return commands
