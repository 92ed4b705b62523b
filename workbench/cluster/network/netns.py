"""Backend ``"netns"`` of ``wb.Cluster(network=...)``: each task in its own network namespace, shaped by ``tc``.

As root on Linux the kernel itself carries the traffic between tasks, as it would between hosts:

- a *switch* namespace holds a bridge; every task has a namespace of its own, joined to the bridge by
  a veth pair, with an address ``10.213.<k>.<i>`` on a subnet no route of this machine uses;
- this kernel reaches every task through one more veth pair whose host end (``10.213.<k>.1``) is the
  only part in this machine's own namespace. Nothing is forwarded (no ``ip_forward``, no NAT): the
  tasks' TF ports are reachable from this machine and from each other, never from another host;
- an engine joins its task's namespace before it starts the TF server (``engine_side.join_namespace``),
  so the server listens there and every connection it opens leaves from there;
- ``tc`` ``htb`` classes on both ends of a task's veth hold what it sends and what it receives to the
  rate in force; ``u32`` filters pick out traffic to and from the tasks it is shaped with, so the
  kernel's own traffic is never shaped. Delay needs ``netem``, which some kernels lack: that is found
  out at start (``netem_problem``) and said when delay is asked for.

Nothing outlives the kernel: the namespaces are held only by file descriptors of this process (no
``/run/netns`` names), so when it exits, or the cluster stops, the namespaces go, and with them
every veth pair and the bridge.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

from ...errors import ClusterStateError, ConfigurationError
from ..process.connection import connect_problem

COMMAND_TIMEOUT = 20.0  # seconds one ip/tc call may take
NAMESPACE_TIMEOUT = 5.0  # seconds a new namespace may take to appear
REACH_TIMEOUT = 15.0  # seconds a new task's server may take to be reachable through its link
REACH_RETRY = 0.2
SUBNETS = "10.213.{}.0/24"  # one per cluster; the first free one is taken
LINE = "100gbit"  # a class that counts traffic without limiting it (a veth carries about 16 Gbit/s here)
MIN_BURST = 64 * 1024  # bytes; tc holds a rate well with a bucket of at least rate/250 (NOTES)
QUANTUM = 65536  # bytes per htb round: one TSO segment on a veth
LINE_BURST = 4 * 1024 * 1024  # bytes: enough that a LINE class never holds anything back
NETEM_LIMIT = 100_000  # packets netem may hold in flight (its default of 1000 drops at Gbit/s with delay)

_CACHE: dict[str, str] = {}


def _run(argv: list[str], namespace: str | None = None, stdin: str | None = None) -> str:
    """Run ``ip``/``tc`` (inside ``namespace``, a path, when given); its output, or ClusterStateError saying why."""
    if namespace is not None:
        argv = ["nsenter", f"--net={namespace}", *argv]
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise ClusterStateError(f"{' '.join(argv[:6])} did not finish in {COMMAND_TIMEOUT:.0f} s") from None
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        raise ClusterStateError(f"{' '.join(argv[:8])} failed: {detail[-1] if detail else f'exit {done.returncode}'}")
    return done.stdout


def problem() -> str:
    """Why the netns backend cannot run here, or ``""`` when it can (checked once per process)."""
    if "problem" not in _CACHE:
        _CACHE["problem"] = _find_problem()
    return _CACHE["problem"]


def _find_problem() -> str:
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "it needs root (creating network namespaces and veth pairs does)"
    missing = [tool for tool in ("ip", "tc", "nsenter", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found (install the Debian packages iproute2 and util-linux)"
    try:
        refused = _refused_qdisc("handle", "1:", "htb")
    except ClusterStateError as exc:
        return f"a network namespace could not be made: {exc}"
    return f"tc cannot shape here: {refused}" if refused else ""


def netem_problem() -> str:
    """Why ``tc`` cannot add delay here (``netem`` missing), or ``""`` (checked once per process)."""
    if "netem" not in _CACHE:
        refused = _refused_qdisc("netem", "delay", "1ms")
        _CACHE["netem"] = (f"this Linux kernel has no netem qdisc (sch_netem), which tc needs for delay ({refused})"
                           if refused else "")
    return _CACHE["netem"]


def _refused_qdisc(*qdisc: str) -> str:
    """tc's error when ``qdisc`` is added as the root of ``lo`` in a scratch namespace; ``""`` when it was taken."""
    holder = Namespace()
    try:
        _run(["tc", "qdisc", "add", "dev", "lo", "root", *qdisc], holder.path)
        return ""
    except ClusterStateError as exc:
        return str(exc)
    finally:
        holder.close()


class Namespace:
    """A new network namespace, held by a file descriptor of this process only (it goes when that closes)."""

    def __init__(self):
        own = os.stat("/proc/self/ns/net").st_ino
        maker = subprocess.Popen(["unshare", "--net", "--", "cat"], stdin=subprocess.PIPE,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + NAMESPACE_TIMEOUT
            while True:  # until unshare has made the new one (before that the child is still in ours)
                try:
                    if os.stat(f"/proc/{maker.pid}/ns/net").st_ino != own:
                        break
                except FileNotFoundError:
                    pass
                if maker.poll() is not None or time.monotonic() > deadline:
                    error = maker.stderr.read().decode(errors="replace").strip() if maker.poll() is not None else ""
                    raise ClusterStateError(f"unshare --net {error or 'did not make a namespace in time'}")
                time.sleep(0.002)
            self.fd = os.open(f"/proc/{maker.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            maker.stdin.close()
            try:
                maker.wait(NAMESPACE_TIMEOUT)
            except subprocess.TimeoutExpired:
                maker.kill()
                maker.wait()
            maker.stderr.close()
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"  # what nsenter and an engine's setns open

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class TaskLink:
    """One task's namespace, its address, and its veth: ``eth0`` inside, ``t<index>`` on the bridge."""

    index: int
    namespace: Namespace
    address: str

    @property
    def port_name(self) -> str:
        return f"t{self.index}"


def free_subnet(template: str = SUBNETS, first: int = 0) -> ipaddress.IPv4Network:
    """The first subnet ``template.format(k)`` (k = ``first``, ``first + 1``... modulo 256) that no address or
    route of this machine falls in; a network left behind by another program (or a killed run) is passed over."""
    used = []
    for line in _run(["ip", "-4", "-o", "addr", "show"]).splitlines() + _run(["ip", "-4", "route", "show"]).splitlines():
        for word in line.replace("/", " /").split():
            try:
                used.append(ipaddress.IPv4Address(word))
            except ValueError:
                continue
    for k in range(256):
        subnet = ipaddress.IPv4Network(template.format((first + k) % 256))
        if not any(address in subnet for address in used):
            return subnet
    raise ClusterStateError(f"no free subnet {template.format('k')} on this machine: stop other clusters with network=")


class NamespaceLinks:
    """The links of one cluster: a switch namespace with a bridge, one namespace per task, tc on each veth."""

    def __init__(self, mtu: int | None = None):
        why = problem()
        if why:
            raise ConfigurationError(f"network backend 'netns' cannot run here: {why}. Use network='auto' (it picks the "
                                     "user-space backend when this one cannot run) or dict(backend='user').")
        self.delay_problem = netem_problem()
        self._subnet = free_subnet()
        self._addresses = self._subnet.hosts()
        gateway = str(next(self._addresses))  # this kernel's end; the tasks take the addresses after it
        self._opened = time.monotonic()
        self._tasks: dict[str, TaskLink] = {}
        self._carried: dict[str, int] = {}  # counters of tc trees that a later apply() replaced
        self._trees: set[tuple[str, str]] = set()  # (task, device) that carry a tree of ours
        self.mtu = mtu  # every veth's and the bridge's (None: the kernel's default, 1500)
        self._switch = Namespace()
        self._host_port = f"wb{os.getpid() % 100000}n{self._subnet.network_address.packed[2]}"
        try:
            _run(["ip", "-batch", "-"], self._switch.path, stdin=(
                f"link set lo up\n{' '.join(['link', 'add', 'br0', *self._mtu_args(), 'type', 'bridge'])}\nlink set br0 up\n"))
            self._add_veth(self._host_port, "kernel", self._switch.path)
            _run(["ip", "-batch", "-"], self._switch.path, stdin="link set kernel master br0\nlink set kernel up\n")
            _run(["ip", "-batch", "-"], stdin=(f"addr add {gateway}/{self._subnet.prefixlen} dev {self._host_port}\n"
                                               f"link set {self._host_port} up\n"))
        except BaseException:
            self.close()
            raise

    def _mtu_args(self) -> list[str]:
        """What ``ip link add`` takes for the links' MTU (nothing: the kernel's default)."""
        return ["mtu", str(self.mtu)] if self.mtu else []

    def _add_veth(self, name: str, peer: str, peer_namespace: str, namespace: str | None = None) -> None:
        """A veth pair: ``name`` in ``namespace`` (None: this one), ``peer`` in ``peer_namespace``; both of ``mtu``."""
        mtu = self._mtu_args()
        _run(["ip", "link", "add", name, *mtu, "type", "veth", "peer", "name", peer, *mtu, "netns", peer_namespace],
             namespace)

    def describe(self) -> str:
        where = f"netns links (bridge {self._subnet}{f', MTU {self.mtu}' if self.mtu else ''}"
        return where + (", no delay: netem is missing)" if self.delay_problem else ")")

    def attach(self, task: str) -> TaskLink:
        """``task``'s namespace (made on first use; a re-hosted task gets its old one back, and its address)."""
        if task in self._tasks:
            return self._tasks[task]
        try:
            address = str(next(self._addresses))
        except StopIteration:
            raise ClusterStateError(f"the links' subnet {self._subnet} has no address left for {task}") from None
        link = TaskLink(len(self._tasks), Namespace(), address)
        try:
            self._add_veth(link.port_name, "eth0", link.namespace.path, self._switch.path)
            _run(["ip", "-batch", "-"], self._switch.path,
                 stdin=f"link set {link.port_name} master br0\nlink set {link.port_name} up\n")
            _run(["ip", "-batch", "-"], link.namespace.path, stdin=(
                f"addr add {address}/{self._subnet.prefixlen} dev eth0\nlink set eth0 up\nlink set lo up\n"))
        except BaseException:
            link.namespace.close()
            raise
        self._tasks[task] = link
        return link

    def follow(self, pids: dict[int, str]) -> None:
        """Nothing to learn: every task's traffic leaves from its own namespace."""

    def reach(self, addresses: dict[str, str], timeout: float = REACH_TIMEOUT) -> None:
        """Wait until this kernel can open a connection to each task's server (``{"worker:1": "10.213.0.4:port"}``).

        A server just started in a new namespace is reached through the bridge; the first packets
        wait for the kernel to learn the task's link address. A task still unreachable after
        ``timeout`` seconds is an error that says what the kernel knows of its neighbour.
        """
        deadline = time.monotonic() + timeout
        for task, address in addresses.items():
            while why := connect_problem(address, max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() + REACH_RETRY > deadline:
                    neighbour = _run(["ip", "neigh", "show", address.rpartition(":")[0]]).strip() or "no entry"
                    raise ClusterStateError(
                        f"{task} at {address} cannot be reached through its link after {timeout:.0f} s ({why}; "
                        f"neighbour: {neighbour}). Stop the cluster and start it again; if this repeats, "
                        "start it with network=dict(backend='user').")
                time.sleep(REACH_RETRY)

    def apply(self, settings: dict[str, dict], pairs: list[list[str]]) -> None:
        """Shape each task's two directions as ``settings`` says, for traffic with the tasks of ``pairs``."""
        if any(s.get("delay") for s in settings.values()) and self.delay_problem:
            raise ConfigurationError(
                f"the netns backend cannot add delay: {self.delay_problem}. Shape the rate only, or start the cluster "
                "with network=dict(backend='user') (the user-space links add delay themselves).")
        plan = tc_plan({task: link.address for task, link in self._tasks.items()},
                       {task: link.port_name for task, link in self._tasks.items()}, settings, pairs)
        before = self._counters()
        for key, value in before.items():  # the counters restart with the new trees
            self._carried[key] = self._carried.get(key, 0) + value
        switch = []
        for task, link in self._tasks.items():
            _run(["tc", "-batch", "-"], link.namespace.path, stdin="\n".join(self._replacing(task, "eth0", plan[task]["out"])))
            switch += self._replacing(task, link.port_name, plan[task]["in"])
        _run(["tc", "-batch", "-"], self._switch.path, stdin="\n".join(switch))

    def _replacing(self, task: str, device: str, lines: list[str]) -> list[str]:
        """``lines`` preceded by removing the tree they replace (none on a task's first shaping)."""
        first = (task, device) not in self._trees
        self._trees.add((task, device))
        return lines if first else [f"qdisc del dev {device} root", *lines]

    def _counters(self) -> dict[str, int]:
        """Bytes in each task's counting classes now: ``"<task> out"`` and ``"<task> in"``."""
        counts = {}
        for task, link in self._tasks.items():
            counts[f"{task} out"] = _class_bytes(_run(["tc", "-s", "class", "show", "dev", "eth0"],
                                                      link.namespace.path))
            counts[f"{task} in"] = _class_bytes(_run(["tc", "-s", "class", "show", "dev", link.port_name],
                                                     self._switch.path))
        return counts

    def stats(self) -> dict:
        """Bytes each task sent to and received from the other tasks (``"ps:0 out"``, ``"ps:0 in"``)."""
        now = self._counters()
        sent = {key: self._carried.get(key, 0) + now.get(key, 0) for key in set(now) | set(self._carried)}
        # tc runs in the kernel's packet path: no process of ours pays for it
        return {"sent": sent, "cpu_seconds": 0.0, "seconds": time.monotonic() - self._opened}

    def close(self) -> None:
        """Remove the links: the host's veth end, then every namespace (their veths and the bridge go with them)."""
        try:
            _run(["ip", "link", "del", self._host_port])
        except ClusterStateError:
            pass  # never made, or gone with the switch
        for link in self._tasks.values():
            link.namespace.close()
        self._tasks.clear()
        self._switch.close()


def _class_bytes(answer: str) -> int:
    """The bytes of the top-level classes in ``tc -s class show`` (a child's bytes are in its parent's)."""
    total, top = 0, False
    for line in answer.splitlines():
        words = line.split()
        if words[:1] == ["class"]:
            top = "root" in words
        elif words[:1] == ["Sent"] and top:
            total += int(words[1])
    return total


def tc_plan(addresses: dict[str, str], ports: dict[str, str], settings: dict[str, dict],
            pairs: list[list[str]]) -> dict[str, dict]:
    """The tc batch lines for every task of ``addresses``: ``{task: {"out": [...] (dev eth0 in its namespace),
    "in": [...] (its veth's end on the bridge, named in ``ports``)}}``.

    Per direction: htb with class ``1:1`` for traffic with the tasks it is shaped with (at the task's
    rate, or unlimited when only a delay applies) and ``1:2`` (unlimited) for traffic with the other
    tasks; both count bytes. Anything else (this kernel's traffic) is not classified and passes
    unshaped. Delay, when asked, sits on the sending side: traffic from A to B waits the larger of A's
    and B's delays, as in the user-space links.
    """
    shaped = {task: set() for task in addresses}
    for a, b in pairs:
        if a in shaped and b in shaped:
            shaped[a].add(b)
            shaped[b].add(a)
    plan = {}
    for task in addresses:
        setting = settings.get(task) or {}
        rate = setting.get("rate")
        delays = {peer: max(setting.get("delay") or 0.0, (settings.get(peer) or {}).get("delay") or 0.0)
                  for peer in shaped[task]}
        plan[task] = {
            "out": _direction("eth0", "dst", addresses, task, [p for p in shaped[task] if rate or delays[p]], rate,
                              delays),
            "in": _direction(ports[task], "src", addresses, task, [p for p in shaped[task] if rate], rate, {}),
        }
    return plan


def _direction(device: str, match: str, addresses: dict[str, str], task: str, shaped: list[str],
               rate: float | None, delays: dict[str, float]) -> list[str]:
    """One direction of ``task``'s link: the other tasks of ``shaped`` through class 1:1, the rest through 1:2."""
    bits = f"{int(rate * 8)}bit" if rate else LINE
    burst = max(MIN_BURST, int(rate / 250)) if rate else LINE_BURST
    lines = [f"qdisc add dev {device} root handle 1: htb default 0",
             _htb_class(device, "1:", "1:1", bits, burst),
             _htb_class(device, "1:", "1:2", LINE, LINE_BURST)]
    groups = sorted({delays.get(peer, 0.0) for peer in shaped})
    leaf = {0.0: "1:1"}  # without delay, 1:1 is the leaf; with delays, one leaf under it per delay
    if any(groups):
        for number, delay in enumerate(groups):
            classid = leaf[delay] = f"1:{10 + number}"
            lines.append(_htb_class(device, "1:1", classid, bits, burst))
            if delay > 0:
                lines.append(f"qdisc add dev {device} parent {classid} handle {10 + number}: netem delay "
                             f"{delay * 1e6:.0f}us limit {NETEM_LIMIT}")
    for peer in sorted(shaped):
        lines.append(f"filter add dev {device} parent 1: protocol ip prio 1 u32 match ip {match} {addresses[peer]}/32 "
                     f"flowid {leaf[delays.get(peer, 0.0)]}")
    for peer in sorted(p for p in addresses if p != task and p not in shaped):
        lines.append(f"filter add dev {device} parent 1: protocol ip prio 1 u32 match ip {match} {addresses[peer]}/32 "
                     "flowid 1:2")
    return lines


def _htb_class(device: str, parent: str, classid: str, bits: str, burst: int) -> str:
    return (f"class add dev {device} parent {parent} classid {classid} htb rate {bits} ceil {bits} burst {burst} "
            f"cburst {burst} quantum {QUANTUM}")
