"""Links between a cluster's tasks that the user can reshape while training runs.

``wb.Cluster(..., network="auto")`` puts an emulated link in front of every task, and
``cluster.shape(rate="1gbit", delay="0.2ms", between=...)`` sets it. The model is one network card
per task, as on separate hosts joined by a switch: what a task sends and what it receives are each
held to its link's rate, and a chunk between two tasks waits the larger of their links' one-way
delays. ``between`` picks the links: every task (default), a job (``"ps"``), one task (``"worker:1"``),
or the traffic between two jobs (``"ps-worker"``). Traffic to and from the notebook kernel is never
shaped: in a real deployment the coordinator's messages are small and often on another network.

Backends: ``"netns"`` (``netns.py``: a network namespace per task, veth pairs to a bridge, ``tc`` on
each; root, Linux) and ``"user"`` (``relay.py``: a process that forwards every connection between tasks
and meters it; no root, so it runs on Binder). Both need local engines. ``"auto"`` picks netns where it
can run, else user, and status names the one in use.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ...errors import ClusterStateError, ConfigurationError
from . import netns

BACKENDS = ("netns", "user")
MTU_RANGE = (68, 65535)  # bytes: IPv4's least, and the most a veth takes
ANSWER_TIMEOUT = 10.0  # seconds the relay may take to answer a command

_RATE_UNITS = {  # tc's notation: "bit" units are bits per second, "bps" units are bytes per second
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
}
_DELAY_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}


def parse_rate(value: Any) -> float:
    """Bits per second from ``"1gbit"``, ``"100mbit"``, ``"125mbps"`` (bytes, as in tc) or a number of bits/s."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(value))
    unit = match and _RATE_UNITS.get(match.group(2).lower())
    if not unit or float(match.group(1)) <= 0:
        raise ConfigurationError(
            f"rate={value!r} is not a link rate: write it as tc does, e.g. '1gbit', '100mbit', '500kbit' (bits "
            "per second) or '125mbps' (bytes per second), or give a positive number of bits per second.")
    return float(match.group(1)) * unit


def parse_delay(value: Any) -> float:
    """Seconds from ``"0.2ms"``, ``"200us"``, ``"1s"`` or a number of seconds (0 or more)."""
    if value is None:
        return 0.0
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(value))
    unit = match and _DELAY_UNITS.get(match.group(2).lower())
    if not unit:
        raise ConfigurationError(
            f"delay={value!r} is not a delay: write e.g. '0.2ms', '200us' or '1s', or give a number of seconds.")
    return float(match.group(1)) * unit


def format_rate(bits: float) -> str:
    for unit, size in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= size:
            return f"{bits / size:g} {unit}"
    return f"{bits:g} bit/s"


def format_delay(seconds: float) -> str:
    return f"{seconds * 1e3:g} ms" if seconds >= 1e-4 else f"{seconds * 1e6:g} us"


@dataclass
class Rule:
    """One ``shape()`` call: which links (``between``), their rate (bits/s, None: unlimited) and delay (s)."""

    between: str
    rate: float | None
    delay: float

    def describe(self) -> str:
        parts = [format_rate(self.rate) if self.rate else "unlimited rate"]
        if self.delay:
            parts.append(f"delay {format_delay(self.delay)}")
        return f"{self.between}: {', '.join(parts)}"


@dataclass
class Shaping:
    """The rules in force, newest last (a later rule overrides an earlier one for the links they share)."""

    rules: list[Rule] = field(default_factory=list)

    def describe(self) -> str:
        return "; ".join(rule.describe() for rule in self.rules) or "unshaped"

    def plan(self, tasks: list[str]) -> tuple[dict[str, dict], list[list[str]]]:
        """Per task ``{"rate": bytes/s or None, "delay": s}``, and the pairs of tasks whose traffic is shaped."""
        settings: dict[str, dict] = {}
        pairs: set[frozenset[str]] = set()
        for rule in self.rules:
            ends, rule_pairs = select_links(rule.between, tasks)
            for task in ends:
                settings[task] = {"rate": rule.rate / 8 if rule.rate else None, "delay": rule.delay}
            pairs |= rule_pairs
        return settings, [sorted(p) for p in pairs]


def select_links(between: str, tasks: list[str]) -> tuple[list[str], set[frozenset[str]]]:
    """The tasks whose links ``between`` sets, and the pairs of tasks whose traffic crosses them."""
    jobs = sorted({t.split(":")[0] for t in tasks})

    def members(name: str) -> list[str]:
        if name in tasks:
            return [name]
        if name in jobs:
            return [t for t in tasks if t.split(":")[0] == name]
        raise ConfigurationError(
            f"between={between!r}: {name!r} is neither a task nor a job of this cluster. Use 'all', a job "
            f"({', '.join(jobs)}), a task ({', '.join(tasks)}) or two jobs joined by '-' (e.g. 'ps-worker').")

    if between in ("all", "*"):
        ends = list(tasks)
        return ends, {frozenset((a, b)) for a in ends for b in tasks if a != b}
    if "-" in between:
        left, _, right = between.partition("-")
        a_side, b_side = members(left.strip()), members(right.strip())
        return sorted(set(a_side) | set(b_side)), {frozenset((a, b)) for a in a_side for b in b_side if a != b}
    ends = members(between)
    return ends, {frozenset((a, b)) for a in ends for b in tasks if a != b}


def parse_mtu(value: Any) -> int | None:
    """The links' frame size in bytes (``mtu=9000``: jumbo frames); None: the links' default, Ethernet's 1500."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and MTU_RANGE[0] <= value <= MTU_RANGE[1]:
        return value
    raise ConfigurationError(
        f"mtu={value!r} is not a frame size: give the links' MTU in bytes, a whole number from {MTU_RANGE[0]} to "
        f"{MTU_RANGE[1]} (1500 is Ethernet's, 9000 jumbo frames), or leave it out for 1500.")


def choose_backend(network: Any) -> tuple[str, Rule | None, int | None]:
    """``wb.Cluster(network=...)``: the backend to use, the rule to start with (None: unshaped links) and the links'
    MTU (None: the default)."""
    if isinstance(network, dict):
        unknown = set(network) - {"backend", "rate", "delay", "between", "mtu"}
        if unknown:
            raise ConfigurationError(f"network={network!r}: unknown key(s) {sorted(unknown)}; use backend, rate, "
                                     "delay, between and mtu.")
        rule = None
        if network.get("rate") is not None or network.get("delay") is not None:
            rule = Rule(str(network.get("between") or "all"),
                        parse_rate(network["rate"]) if network.get("rate") is not None else None,
                        parse_delay(network.get("delay")))
        mtu = parse_mtu(network.get("mtu"))
        return _backend(network.get("backend", "auto"), rule, mtu), rule, mtu
    if network in ("auto", *BACKENDS):
        return _backend(network, None), None, None
    if isinstance(network, (str, int, float)) and not isinstance(network, bool):
        try:
            rule = Rule("all", parse_rate(network), 0.0)
        except ConfigurationError:
            pass  # neither a backend nor a rate: say what network= takes
        else:
            return _backend("auto", rule), rule, None
    raise ConfigurationError(
        f"network={network!r}: use 'auto' (emulated links you can shape later with cluster.shape(...)), a rate "
        "such as '1gbit' (every link at that rate from the start), or a dict(rate=..., delay=..., between=..., "
        "mtu=..., backend='auto'|'netns'|'user').")


def _backend(name: str, rule: Rule | None, mtu: int | None = None) -> str:
    """``"auto"``: netns where it can run (root, Linux) unless the first rule asks a delay this kernel cannot add.
    An MTU needs netns: the relay forwards a stream of bytes and has no frames."""
    chosen = _named_backend(name, rule)
    if mtu is not None and chosen == "user":
        why = ("backend 'user' was asked for" if name == "user" else
               f"the netns links cannot run here ({netns.problem()})" if netns.problem() else
               f"the first rule's delay needs the user-space relay here ({netns.netem_problem()})")
        raise ConfigurationError(
            f"mtu={mtu} needs the netns links (frames on a veth), but {why}, and the user-space relay forwards "
            "bytes, not frames. Leave mtu out, or use backend 'netns' (as root, on Linux).")
    return chosen


def _named_backend(name: str, rule: Rule | None) -> str:
    if name == "auto":
        if netns.problem() or (rule is not None and rule.delay and netns.netem_problem()):
            return "user"
        return "netns"
    if name == "netns" and netns.problem():
        raise ConfigurationError(
            f"network backend 'netns' cannot run here: {netns.problem()}. Use backend 'user' (a user-space relay: no "
            "root needed; it holds rates within a few percent up to 10 Gbit/s per link, at a CPU cost, see bench/network.py), "
            "or 'auto', which picks it when netns cannot run.")
    if name not in BACKENDS:
        raise ConfigurationError(f"network backend {name!r} is unknown: use 'auto', 'netns' or 'user'.")
    return name


class UserSpaceLinks:
    """The kernel's handle on the relay process (``relay.py``): one per cluster with ``network=``."""

    def __init__(self, host: str = "127.0.0.1"):
        self._process = subprocess.Popen(
            [sys.executable, "-m", "workbench.cluster.network.relay", host],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            start_new_session=True,  # a Ctrl-C in the notebook goes to the kernel, not to the links
        )
        self.pid = self._process.pid
        self._buffer = b""
        self._next_id = 0
        ready = self._answer(None, "starting the link relay")
        if not ready.get("ready"):
            self.close()
            raise ClusterStateError(f"the link relay did not start: {ready}")

    def _answer(self, wanted: int | None, what: str) -> dict:
        deadline = time.monotonic() + ANSWER_TIMEOUT
        out = self._process.stdout.fileno()
        while True:
            line, newline, rest = self._buffer.partition(b"\n")
            if newline:
                self._buffer = rest
                answer = json.loads(line)
                if wanted is None or answer.get("id") == wanted:
                    return answer
                continue
            left = deadline - time.monotonic()
            if left <= 0 or self._process.poll() is not None:
                why = "exited" if self._process.poll() is not None else f"did not answer in {ANSWER_TIMEOUT:.0f} s"
                raise ClusterStateError(f"the link relay (pid {self.pid}) {why} while {what}: stop the cluster and "
                                        "start it again.")
            if select.select([out], [], [], left)[0]:
                chunk = os.read(out, 65536)
                if not chunk:
                    continue
                self._buffer += chunk

    def call(self, what: str, **message: Any) -> dict:
        self._next_id += 1
        try:
            self._process.stdin.write((json.dumps({"id": self._next_id, **message}) + "\n").encode())
            self._process.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise ClusterStateError(f"the link relay (pid {self.pid}) is gone, so {what} failed: stop the cluster "
                                    "and start it again.") from None
        answer = self._answer(self._next_id, what)
        if not answer.get("ok"):
            raise ClusterStateError(f"the link relay failed while {what}: {answer.get('error')}")
        return answer

    def listen(self, task: str, target: str) -> int:
        """The relay's port for ``task`` (the same for its lifetime), now forwarding to ``target``."""
        return int(self.call(f"putting a link in front of {task}", do="listen", task=task, target=target)["port"])

    def processes(self, pids: dict[int, str]) -> None:
        """Which process is which task (connections from other processes are the kernel's: not shaped)."""
        self.call("telling the relay the tasks' processes", do="pids", pids={str(p): t for p, t in pids.items()})

    follow = processes  # what every backend is told when tasks change

    def describe(self) -> str:
        return f"user-space links (pid {self.pid})"

    def apply(self, settings: dict[str, dict], pairs: list[list[str]]) -> None:
        self.call("shaping the links", do="shape", tasks=settings, pairs=pairs)

    def stats(self) -> dict:
        """Bytes each task sent (``"ps:0 out"``) and received (``"ps:0 in"``), and the relay's CPU seconds."""
        return self.call("reading link statistics", do="stats")

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                self._process.stdin.close()  # the relay exits when its stdin closes
                self._process.wait(5)
            except (subprocess.TimeoutExpired, OSError):
                self._process.kill()
                self._process.wait(5)
        for stream in (self._process.stdin, self._process.stdout):
            try:
                stream.close()
            except OSError:
                pass
