"""Several hosts on one machine, for tests run as root: network namespaces on a bridge of the test's own.

``EmulatedHosts(3)`` makes a bridge with the head node's address (this process: the kernel, the
controller) and, per host, a network namespace joined to the bridge by a veth pair, with an address
of its own on that private /24 (10.232.N.0, the first N from a random one that no address or
route of this machine uses), a UTS namespace with its own host name
(``host1``...), and an sshd that lets this user in with a throwaway key (``tests/sshd.py``). Engines
then start in a host by SSH (``engines="ssh"``). Nothing leaves the bridge: it has no other port
and no route out.

``kill(host)`` kills every process of that host (what ``ip netns pids`` lists: sshd, engines, TF
servers), as a host that fails does. ``close()`` stops what is left and removes namespaces and bridge.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass

import netns
import sshd

from workbench.cluster.network.netns import free_subnet

TIMEOUT = 30


def available() -> str:
    """Why emulated hosts cannot be made here, or ``""`` (installs iproute2 and OpenSSH as root when missing)."""
    if os.geteuid() != 0:
        return "network namespaces and a bridge need root (CI runs as root)"
    return netns.available() or sshd.available()


@dataclass
class Host:
    name: str  # its host name (what an engine's socket.gethostname() says there)
    namespace: str
    address: str  # on the bridge
    sshd: sshd.LocalSSHD | None = None

    @property
    def ssh_host(self) -> str:
        """The key of ``hosts=`` for this host: ``address:port``."""
        return f"{self.address}:{self.sshd.port}"

    def pids(self) -> list[int]:
        result = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True, text=True, timeout=TIMEOUT)
        return [int(p) for p in result.stdout.split()]

    def kill_all(self) -> list[int]:
        """SIGKILL every process of this host; return their pids."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids


class EmulatedHosts:
    def __init__(self, count: int = 3, env: dict[str, str] | None = None) -> None:
        """``env``: variables every session on every host gets (``CUDA_VISIBLE_DEVICES``: a node's GPUs)."""
        # a random start: the two halves of `make test` run side by side; a network someone left is passed over
        n = free_subnet("10.232.{}.0/24", first=random.randint(1, 250)).network_address.packed[2]
        tag = f"{os.getpid() % 10000}{n}"
        self.bridge = f"wbbr{tag}"
        self.head = f"10.232.{n}.1"  # this process's address on the bridge: pass it as controller_ip
        self.hosts: list[Host] = []
        self._links: list[str] = []
        try:
            netns.ip("link", "add", self.bridge, "type", "bridge")
            netns.ip("addr", "add", f"{self.head}/24", "dev", self.bridge)
            netns.ip("link", "set", self.bridge, "up")
            for i in range(count):
                self.hosts.append(self._add_host(tag, n, i))
            for host in self.hosts:
                host.sshd = sshd.LocalSSHD(host=host.address, netns=host.namespace, hostname=host.name, env=env)
        except BaseException:
            self.close()
            raise

    def _add_host(self, tag: str, n: int, i: int) -> Host:
        host = Host(f"host{i + 1}", f"wbhost{tag}x{i}", f"10.232.{n}.{11 + i}")
        outside, inside = f"wbv{tag}x{i}", f"wbe{tag}x{i}"
        netns.ip("netns", "add", host.namespace)
        netns.ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        self._links.append(outside)
        netns.ip("link", "set", inside, "netns", host.namespace)
        netns.ip("link", "set", outside, "master", self.bridge)
        netns.ip("link", "set", outside, "up")
        for args in (("addr", "add", f"{host.address}/24", "dev", inside), ("link", "set", inside, "up"),
                     ("link", "set", "lo", "up")):
            netns.ip("netns", "exec", host.namespace, "ip", *args)
        return host

    @property
    def ssh_args(self) -> list[str]:
        """Every host's sshd accepts its own key; the client offers them all."""
        keys = [arg for host in self.hosts for arg in ("-i", str(host.sshd.key))]
        return keys + sshd.CLIENT_OPTIONS

    def bridge_bytes(self) -> int:
        """Bytes that crossed the bridge so far (received by it from the hosts, both ways summed)."""
        total = 0
        for link in self._links:
            for direction in ("rx_bytes", "tx_bytes"):
                with open(f"/sys/class/net/{link}/statistics/{direction}") as counter:
                    total += int(counter.read())
        return total

    def kill(self, host: Host) -> list[int]:
        """SIGKILL every process of ``host``, as a machine that fails; return their pids."""
        pids = host.kill_all()
        deadline = time.monotonic() + TIMEOUT
        while host.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        if host.sshd is not None and host.sshd.process is not None:
            host.sshd.process.wait(timeout=TIMEOUT)  # reap it: it was this process's child
        return pids

    def close(self) -> None:
        for host in self.hosts:
            if host.sshd is not None:
                host.sshd.close()
            host.kill_all()
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True, timeout=TIMEOUT)
        for link in self._links:
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=TIMEOUT)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=TIMEOUT)
