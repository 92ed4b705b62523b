"""``cluster.links``: the emulated links between a cluster's tasks, which ``cluster.shape(...)`` reshapes.

Held by the ``Cluster`` (it reads the cluster's tasks and takes its lifecycle lock). With ``network=`` given, every
byte between two tasks crosses an emulated link that holds it to the shaping in force: with backend
``"user"`` a task's address in the ClusterSpec is the relay's port for it and its TF server listens
behind it; with ``"netns"`` the task lives in a network namespace of its own and its address is there.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ..errors import ClusterStateError, ConfigurationError
from ..telemetry.events import LinkEvent
from .health import RUNNING
from .network.netns import NamespaceLinks
from .network.shaping import Rule, Shaping, UserSpaceLinks, choose_backend, parse_delay, parse_rate


class ClusterLinks:
    """Emulated links between a cluster's tasks (``network=`` of ``wb.Cluster``), reshaped with ``shape()``.

    ``emulator`` is the back end carrying them while the cluster runs (``UserSpaceLinks``: the relay
    process; ``NamespaceLinks``: namespaces and tc), None without ``network=`` or when stopped.
    """

    def __init__(self, cluster, network: Any, local: bool):
        self.cluster = cluster
        self.backend: str | None = None  # "netns" or "user"; None: tasks talk directly
        self._first_rule: Rule | None = None
        self._mtu: int | None = None  # the netns links' frame size (None: 1500)
        self.emulator: UserSpaceLinks | NamespaceLinks | None = None
        self._shaping = Shaping()
        if network is None or network is False:
            return
        if not local:
            raise ConfigurationError(
                f"network={network!r} needs local engines: the links are emulated on this machine, which must hold "
                "both ends of every connection. Leave network= out for engines on other hosts (their links are the "
                "real network).")
        self.backend, self._first_rule, self._mtu = choose_backend(network)

    def open(self) -> None:
        """At start: the links, before any task is given its address."""
        if self.backend is None:
            return
        self.emulator = NamespaceLinks(self._mtu) if self.backend == "netns" else UserSpaceLinks()
        self._shaping = Shaping([self._first_rule] if self._first_rule else [])
        if self._first_rule:
            self.cluster.telemetry.append(LinkEvent(time.time(), self._shaping.describe()))

    def close(self) -> None:
        emulator, self.emulator = self.emulator, None
        if emulator is not None:
            emulator.close()

    def address_for(self, task: str, serving: str) -> tuple[str, int | None, dict | None]:
        """For a task whose server was given the address ``serving``: the address to name in the ClusterSpec,
        the port the server listens on when that differs (None: the named one), and the network namespace it
        joins first (None: none)."""
        port = serving.rpartition(":")[2]
        if isinstance(self.emulator, NamespaceLinks):  # the task's own namespace, at its address there
            link = self.emulator.attach(task)
            return f"{link.address}:{port}", None, {"path": link.namespace.path, "address": link.address}
        return self.relink(task, serving), int(port), None

    def relink(self, task: str, serving: str) -> str:
        """The relay's address for ``task``, now forwarding to ``serving``."""
        return f"127.0.0.1:{self.emulator.listen(task, serving)}"

    def follow_tasks(self) -> None:
        """Tasks were added or re-hosted: tell the links which process is which, and shape them."""
        if self.emulator is None:
            return
        tasks = self.cluster.tasks
        self.emulator.follow({r.pid: r.name for r in tasks} | {os.getpid(): "client"})
        self.emulator.apply(*self._shaping.plan([r.name for r in tasks]))
        if isinstance(self.emulator, NamespaceLinks):  # the servers are reached through the bridge before anyone uses them
            self.emulator.reach({r.name: r.address for r in tasks if r.state == RUNNING})

    def shape(self, rate: Any = None, delay: Any = None, between: str = "all") -> str:
        """Set the links between tasks while they run; ``shape(None)`` makes every link unshaped again.

        ``rate`` as tc writes it (``"1gbit"``, ``"100mbit"``; ``"125mbps"`` is bytes/s) or bits/s;
        ``delay`` one way (``"0.2ms"``, ``"50us"``, seconds). ``between``: ``"all"`` (every task's
        link), a job (``"ps"``), a task (``"worker:1"``), or two jobs (``"ps-worker"``: only traffic
        between them). Each task is like a host with one network card of that rate: what it sends
        and what it receives are each held to it, so a ps serving three workers at 1 Gbit/s gives
        each about a third. A later call overrides an earlier one for the links both set. Traffic
        to and from this kernel is not shaped. Returns the shaping now in force, as in ``status()``.
        Needs ``network=`` when the cluster is made.
        """
        cluster = self.cluster
        with cluster.lifecycle:
            cluster.require_running("shape its links")
            if cluster.attached:
                raise ClusterStateError(f"cluster {cluster.name!r} is attached: process {cluster.owner_pid} owns it and "
                                        "its links; shape them there.")
            if self.emulator is None:
                raise ClusterStateError(
                    f"cluster {cluster.name!r} was started without emulated links, so they cannot be shaped: start it "
                    "with wb.Cluster(..., network='auto') (or network='1gbit' to start shaped), then call "
                    "cluster.shape(...).")
            shaping = Shaping()
            if rate is not None or delay is not None:
                rule = Rule(str(between), parse_rate(rate) if rate is not None else None, parse_delay(delay))
                shaping = Shaping([r for r in self._shaping.rules if r.between != rule.between] + [rule])
            plan = shaping.plan([r.name for r in cluster.tasks])  # checks every rule before anything changes
            self.emulator.apply(*plan)
            self._shaping = shaping
            cluster.telemetry.append(LinkEvent(time.time(), self._shaping.describe()))  # a band on the timeline
            cluster.shared.write_record()
            return self.describe()

    @property
    def shaped(self) -> bool:
        """True while a ``shape()`` rule is in force (False without emulated links, or after ``shape(None)``)."""
        return bool(self._shaping.rules)

    def describe(self) -> str:
        """The links between tasks: the backend and the shaping in force (``""`` without ``network=``)."""
        if self.backend is None:
            return ""
        where = self.emulator.describe() if self.emulator is not None else f"{self.backend} links"
        return f"{where}: {self._shaping.describe()}"

    def stats(self) -> dict:
        """Bytes each task sent and received through its link so far, and the emulator's CPU seconds."""
        if self.emulator is None:
            raise ClusterStateError(f"cluster {self.cluster.name!r} has no emulated links (start it with network='auto').")
        answer = self.emulator.stats()
        return {"sent": answer["sent"], "cpu_seconds": answer["cpu_seconds"], "seconds": answer["seconds"]}
