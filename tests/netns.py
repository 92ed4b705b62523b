"""Another host on a link of the test's own, for tests run as root: a network namespace joined to this one by a veth pair.

``Peer()`` makes the namespace and the pair, with addresses chosen here on that link only (IPv4
10.231.N.0/30, N one that no address or route of this machine uses, and IPv6 fd31:23:N::/64, no
duplicate detection so they work at once). ``run(argv)`` runs a command inside the namespace;
``host4``/``host6`` are this machine's addresses as the peer sees them. ``close()`` removes the namespace (and the pair with it).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import time

import debian

from workbench.cluster.network.netns import free_subnet

TIMEOUT = 30


def available() -> str:
    """Why a peer cannot be made here, or ``""``; installs iproute2 when it is missing and we are root."""
    if os.geteuid() != 0:
        return "making a network namespace needs root (CI runs as root)"
    return debian.ensure(["ip"], ["iproute2"], "the `ip` command")


def ip(*args: str) -> None:
    """``ip args...``; raises with ip's own message when it fails."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=TIMEOUT)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


class Peer:
    def __init__(self) -> None:
        n = free_subnet("10.231.{}.0/30", first=random.randint(1, 250)).network_address.packed[2]
        tag = f"{os.getpid() % 10000}{n}"
        self.namespace, self.host_link, self.peer_link = f"wbpeer{tag}", f"wbh{tag}", f"wbp{tag}"
        self.host4, self.peer4 = f"10.231.{n}.1", f"10.231.{n}.2"
        self.host6, self.peer6 = f"fd31:23:{n:x}::1", f"fd31:23:{n:x}::2"
        ip("netns", "add", self.namespace)
        try:
            ip("link", "add", self.host_link, "type", "veth", "peer", "name", self.peer_link)
            ip("link", "set", self.peer_link, "netns", self.namespace)
            ip("addr", "add", f"{self.host4}/30", "dev", self.host_link)
            ip("addr", "add", f"{self.host6}/64", "dev", self.host_link, "nodad")
            ip("link", "set", self.host_link, "up")
            for args in (("addr", "add", f"{self.peer4}/30", "dev", self.peer_link),
                         ("addr", "add", f"{self.peer6}/64", "dev", self.peer_link, "nodad"),
                         ("link", "set", self.peer_link, "up"), ("link", "set", "lo", "up")):
                ip("netns", "exec", self.namespace, "ip", *args)
            self.wait_reachable()
        except BaseException:
            self.close()
            raise

    def wait_reachable(self, timeout: float = 10.0) -> None:
        """Wait until this machine answers the peer's ping (the link is up both ways)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.run(["ping", "-c", "1", "-W", "1", self.host4], timeout=5).returncode == 0 or not shutil.which("ping"):
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.host4} did not answer from the namespace {self.namespace}")

    def run(self, argv: list[str], timeout: float = 120.0) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.namespace, *argv], capture_output=True, text=True,
                              timeout=timeout)

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True, timeout=TIMEOUT)
        subprocess.run(["ip", "link", "del", self.host_link], capture_output=True, timeout=TIMEOUT)
