"""Emulated links between tasks: the user-space relay, wb.Cluster(network=...), cluster.shape(...) and %wb shape."""

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import debian
import keras
import psutil
import pytest
from conftest import read_line
from IPython.core.interactiveshell import InteractiveShell
from training_helpers import LOSS, make_model, wait_for

import workbench as wb
from workbench.cluster.network import netns
from workbench.cluster.network.shaping import Rule, Shaping, UserSpaceLinks
from workbench.errors import ClusterStateError, ConfigurationError
from workbench.telemetry.events import LinkEvent

pytestmark = pytest.mark.cluster


class Sink:
    """A server that counts what it receives and echoes each chunk back when asked to."""

    def __init__(self, echo: bool = False):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.received = 0
        self.echo = echo
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        self.server.settimeout(30)
        connection, _ = self.server.accept()
        with connection:
            while data := connection.recv(1 << 20):
                self.received += len(data)
                if self.echo:
                    connection.sendall(data)


@pytest.fixture
def relay():
    links = UserSpaceLinks()
    yield links
    links.close()


def blast(port: int, seconds: float) -> None:
    """Send as fast as the path takes for ``seconds``."""
    chunk = b"x" * (1 << 18)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            sock.sendall(chunk)


def shaped_to(relay, rate_bytes: float, delay: float = 0.0, me: str = "worker:0"):
    relay.processes({os.getpid(): me} if me else {})
    settings = {t: {"rate": rate_bytes, "delay": delay} for t in ("ps:0", "worker:0")}
    relay.apply(settings, [["ps:0", "worker:0"]])


def test_the_relay_holds_a_task_to_its_rate_and_lets_the_kernel_through(relay):
    slow = Sink()
    shaped_to(relay, 2.5e6)  # 20 Mbit/s
    blast(relay.listen("ps:0", f"127.0.0.1:{slow.port}"), 2.0)
    # both directions' counters: they are updated one after the other (a reading between them differed by a chunk)
    seen = {}

    def drained() -> bool:
        seen.update(before=relay.stats()["sent"], received=slow.received, after=relay.stats()["sent"])
        return seen["before"].get("ps:0 in", 0) == seen["received"] == seen["after"].get("worker:0 out")

    wait_for(drained, 10, lambda: f"the relay to drain, counted as worker:0's (last seen: {seen})")
    assert slow.received < 2.0 * 2.5e6 * 1.5, f"{slow.received} bytes in 2 s through a 2.5 MB/s link"

    kernel = Sink()
    shaped_to(relay, 2.5e6, me="")  # this process is no task: its traffic is the kernel's, never shaped
    blast(relay.listen("worker:0", f"127.0.0.1:{kernel.port}"), 2.0)
    assert kernel.received > 4 * slow.received, (kernel.received, slow.received)


def test_the_relay_adds_the_delay_each_way(relay):
    echo = Sink(echo=True)
    port = relay.listen("ps:0", f"127.0.0.1:{echo.port}")
    shaped_to(relay, None, delay=0.025)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        times = []
        for _ in range(5):
            began = time.monotonic()
            sock.sendall(b"ping")
            assert sock.recv(16) == b"ping"
            times.append(time.monotonic() - began)
    assert min(times) >= 0.05, f"round trips through two 25 ms one-way delays: {times}"


def test_the_relay_goes_when_its_kernel_dies():
    child = subprocess.Popen([sys.executable, "-c", (
        "import time\nfrom workbench.cluster.network.shaping import UserSpaceLinks\n"
        "print(UserSpaceLinks().pid, flush=True)\ntime.sleep(120)")], stdout=subprocess.PIPE, text=True)
    try:
        relay_pid = int(read_line(child, 60, "its relay's pid"))
        assert psutil.pid_exists(relay_pid)
    finally:
        child.kill()
        child.wait(10)
    wait_for(lambda: not psutil.pid_exists(relay_pid) or psutil.Process(relay_pid).status() == psutil.STATUS_ZOMBIE,
             10, f"the relay (pid {relay_pid}) to exit after its kernel was killed")


def need_netns() -> None:
    """Skip unless the netns backend runs here (as root, iproute2 is installed first when missing)."""
    if os.geteuid() == 0 and not debian.ensure(["ip", "tc", "ss", "nsenter", "unshare"], ["iproute2", "util-linux"],
                                               "iproute2") and "not found" in netns._CACHE.get("problem", ""):
        del netns._CACHE["problem"]  # found missing before the install: look again
    if netns.problem():
        pytest.skip(f"the netns backend cannot run here: {netns.problem()} (CI runs as root, where it does)")


def can_delay(cluster) -> bool:
    return cluster.links.backend == "user" or not netns.netem_problem()


@pytest.fixture(scope="module", params=["user", "netns"])
def linked(request):
    """A running cluster with emulated links, once per backend."""
    if request.param == "netns":
        need_netns()
    cluster = wb.Cluster(ps=1, workers=2, name=f"wb-test-links-{request.param}", network=dict(backend=request.param),
                         progress=False).start()
    yield cluster
    cluster.stop()


def network_namespace(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def test_every_task_is_reached_through_its_link(linked):
    if linked.links.backend == "user":
        relay = psutil.Process(linked.links.emulator.pid)
        listening = {c.laddr.port for c in relay.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        for record in linked.tasks:
            assert int(record.address.rsplit(":", 1)[1]) in listening, f"{record.name} is not behind the relay"
        assert "links: user-space links" in str(linked.status())
    else:  # each task in a namespace of its own, at its own address on the cluster's bridge
        spaces = {record.name: network_namespace(record.pid) for record in linked.tasks}
        assert len(set(spaces.values()) | {network_namespace(os.getpid())}) == len(spaces) + 1, spaces
        assert all(record.address.startswith("10.213.") for record in linked.tasks)
        assert "links: netns links (bridge 10.213." in str(linked.status())
    assert "unshaped" in linked.network


def running_job(cluster):
    return wb.train(cluster, make_model, wb.datasets.digits, LOSS, keras.optimizers.Adam(1e-3), steps=200_000,
                    batch_size=64, seed=2, telemetry=False)


def ps_bytes_out(cluster, seconds: float) -> int:
    before = cluster.link_stats()["sent"].get("ps:0 out", 0)
    time.sleep(seconds)
    return cluster.link_stats()["sent"].get("ps:0 out", 0) - before


def test_shaping_takes_effect_while_a_job_runs(linked):
    job = running_job(linked)
    try:
        wait_for(lambda: len(job.history) >= 30 or job.state != "running", 120, "30 steps")
        free = ps_bytes_out(linked, 1.5)
        # 125 kB/s for the ps's card: far below what a loaded machine's unshaped job sends (1.4 MB/s measured)
        described = linked.shape("1mbit")
        assert described.endswith("all: 1 Mbit/s")
        time.sleep(0.5)  # what was in flight drains
        shaped = ps_bytes_out(linked, 1.5)
        assert shaped < 1.5 * 0.125e6 * 1.5, f"{shaped} bytes from the ps in 1.5 s at 1 Mbit/s"
        assert free > 3 * shaped, f"unshaped {free} bytes vs shaped {shaped} bytes in 1.5 s"
        assert linked.shape(None).endswith("unshaped")
        assert job.state == "running"
        changes = [e.shaping for e in linked.telemetry.since(0).events if isinstance(e, LinkEvent)]
        assert changes[-2:] == ["all: 1 Mbit/s", "unshaped"]  # the dashboard's timeline shades between them
    finally:
        job.stop()
        job.wait(120)
    stats = linked.link_stats()["sent"]
    for task in ("ps:0", "worker:0", "worker:1"):
        assert stats.get(f"{task} out", 0) > 0 and stats.get(f"{task} in", 0) > 0, f"{task} not identified: {stats}"


def test_rules_show_in_status_and_a_task_keeps_its_link_when_re_hosted(linked):
    if not can_delay(linked):
        with pytest.raises(ConfigurationError, match=r"cannot add delay: this Linux kernel has no netem.*backend='user'"):
            linked.shape("100mbit", delay="1ms", between="ps-worker")
    delay = "1ms" if can_delay(linked) else None
    linked.shape("100mbit", delay=delay, between="ps-worker")
    linked.shape("10mbit", between="worker:1")
    status = str(linked.status())
    assert f"ps-worker: 100 Mbit/s{', delay 1 ms' if delay else ''}; worker:1: 10 Mbit/s" in status
    address = linked.task("worker:1").address
    linked.replace_task("worker:1")
    assert linked.task("worker:1").address == address
    job = wb.train(linked, make_model, wb.datasets.digits, LOSS, steps=100, batch_size=64, telemetry=False)
    job.wait(120)
    assert job.state == "finished", job.error
    linked.shape(None)


def test_bad_shaping_says_what_to_do(linked, cluster):
    with pytest.raises(ConfigurationError, match="neither a task nor a job"):
        linked.shape("1gbit", between="worker:7")
    with pytest.raises(ConfigurationError, match="not a link rate"):
        linked.shape("quick")
    with pytest.raises(ClusterStateError, match="network='auto'"):
        cluster.shape("1gbit")
    with pytest.raises(ConfigurationError, match="needs local engines"):
        wb.Cluster(engines="ssh", network="auto", hosts={"node1": 1})


def test_shape_magic(linked, capsys):
    shell = InteractiveShell.instance()
    shell.extension_manager.load_extension("workbench")
    delay = " --delay 0.2ms" if can_delay(linked) else ""
    shell.run_line_magic("wb", f"shape 1gbit{delay} --between ps --name {linked.name}")
    shell.run_line_magic("wb", f"shape --name {linked.name}")
    shell.run_line_magic("wb", f"shape off --name {linked.name}")
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("ps: 1 Gbit/s" + (", delay 0.2 ms" if delay else ""))
    assert out[1] == out[0] and out[2].endswith("unshaped")


def host_links() -> set[str]:
    return {line.split()[0].split("@")[0] for line in subprocess.run(
        ["ip", "-br", "link"], capture_output=True, text=True, timeout=10).stdout.splitlines()}


@pytest.mark.parametrize("backend", ["user", "netns"])
def test_stopping_the_cluster_removes_its_links(backend):
    if backend == "netns":
        need_netns()
    before = host_links() if backend == "netns" else set()
    cluster = wb.Cluster(ps=1, workers=1, name=f"wb-test-links-stop-{backend}", progress=False,
                         network=dict(backend=backend, rate="1gbit")).start()
    try:
        pid = cluster.links.emulator.pid if backend == "user" else None
        added = host_links() - before if backend == "netns" else set()
        assert "all: 1 Gbit/s" in cluster.network
    finally:
        cluster.stop()
    if backend == "user":
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    else:
        assert len(added) == 1 and not added & host_links(), f"the host end of the kernel's link stayed: {added}"


# -- the netns backend on its own ------------------------------------------------------------

SINK = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
server.settimeout(30)
connection, _ = server.accept()
total = 0
while data := connection.recv(1 << 20):
    total += len(data)
print(total, flush=True)
"""


def sink_in(link, port: int) -> subprocess.Popen:
    """A process in ``link``'s namespace that counts what reaches ``link.address:port`` and prints it."""
    sink = subprocess.Popen(["nsenter", f"--net={link.namespace.path}", sys.executable, "-c", SINK, link.address,
                             str(port)], stdout=subprocess.PIPE, text=True)
    wait_for(lambda: subprocess.run(["nsenter", f"--net={link.namespace.path}", "ss", "-ltn"], capture_output=True,
                                    text=True, timeout=10).stdout.count(f":{port} ") > 0, 10, "the sink to listen")
    return sink


def blast_from(link, target, port: int, seconds: float) -> None:
    code = ("import socket, sys, time\nsock = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)\n"
            "chunk, until = b'x' * (1 << 18), time.monotonic() + float(sys.argv[3])\n"
            "while time.monotonic() < until:\n    sock.sendall(chunk)\n")
    command = [sys.executable, "-c", code, target.address, str(port), str(seconds)]
    if link is not None:
        command = ["nsenter", f"--net={link.namespace.path}", *command]
    subprocess.run(command, check=True, timeout=seconds + 30)


@pytest.fixture
def namespaces():
    need_netns()
    links = netns.NamespaceLinks()
    yield links
    links.close()


def _settled(namespaces, seconds: float = 10.0) -> dict:
    """The links' byte counters once no packet moved for half a second (at most ``seconds``)."""
    deadline, last = time.monotonic() + seconds, namespaces.stats()["sent"]
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = namespaces.stats()["sent"]
        if now == last:
            break
        last = now
    return last


def test_a_subnet_in_use_on_this_machine_is_passed_over():
    """A network some other program (or a killed run) left in place is never taken for a cluster's links: its
    addresses would reach that network, not the cluster (a peer that refuses every connection)."""
    if not shutil.which("ip"):
        pytest.skip("needs the `ip` command (iproute2)")
    assert netns.free_subnet("127.0.{}.0/24").exploded == "127.0.1.0/24"  # 127.0.0.1 is this machine's
    assert netns.free_subnet("127.0.{}.0/24", first=255).exploded == "127.0.255.0/24"


def test_netns_links_hold_a_task_to_its_rate_and_let_the_kernel_through(namespaces):
    ps, worker = namespaces.attach("ps:0"), namespaces.attach("worker:0")
    namespaces.apply(Shaping([Rule("all", 20e6, 0.0)]).plan(["ps:0", "worker:0"])[0],
                     [["ps:0", "worker:0"]])
    slow = sink_in(ps, 7000)
    blast_from(worker, ps, 7000, 2.0)
    received = int(slow.communicate(timeout=30)[0])
    assert received < 2.0 * 2.5e6 * 1.5, f"{received} bytes in 2 s through a 20 Mbit/s link"
    sent = _settled(namespaces)  # the transfer's last packets too (its close: a 66-byte packet once came after)
    assert sent["worker:0 out"] >= received and sent["ps:0 in"] >= received, sent  # counted on the wire

    kernel = sink_in(ps, 7001)
    blast_from(None, ps, 7001, 2.0)  # from this process: the kernel's traffic is never shaped
    assert int(kernel.communicate(timeout=30)[0]) > 4 * received
    assert namespaces.stats()["sent"]["ps:0 in"] == sent["ps:0 in"], "the kernel's traffic was counted as a task's"


SEGMENT = """
import socket, sys
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
sock.sendall(b"x" * 100000)
print(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG), flush=True)
"""


@pytest.mark.parametrize("mtu, segment", [(None, (1400, 1460)), (9000, (8900, 8960))], ids=["default", "jumbo"])
def test_netns_links_carry_frames_of_the_mtu_asked_at_the_rate_set(mtu, segment):
    """``network=dict(mtu=9000)``: every veth and the bridge take jumbo frames (TCP between two tasks sends
    segments of about 8.9 kB), and tc still holds a task to its rate."""
    need_netns()
    links = netns.NamespaceLinks(mtu)
    try:
        ps, worker = links.attach("ps:0"), links.attach("worker:0")
        assert ("MTU 9000" in links.describe()) == (mtu == 9000)
        links.apply(Shaping([Rule("all", 20e6, 0.0)]).plan(["ps:0", "worker:0"])[0], [["ps:0", "worker:0"]])
        sink = sink_in(ps, 7004)
        sent = subprocess.run(["nsenter", f"--net={worker.namespace.path}", sys.executable, "-c", SEGMENT, ps.address,
                               "7004"], capture_output=True, text=True, timeout=30, check=True)
        sink.communicate(timeout=30)
        assert segment[0] <= int(sent.stdout) <= segment[1], f"TCP segments of {sent.stdout.strip()} bytes with mtu={mtu}"
        slow = sink_in(ps, 7005)
        blast_from(worker, ps, 7005, 2.0)
        received = int(slow.communicate(timeout=30)[0])
        assert 2.0 * 2.5e6 * 0.5 < received < 2.0 * 2.5e6 * 1.5, f"{received} bytes in 2 s through a 20 Mbit/s link"
    finally:
        links.close()


def test_netns_links_are_reached_before_use_and_a_dead_link_says_so(namespaces):
    ps = namespaces.attach("ps:0")
    sink = sink_in(ps, 7002)
    namespaces.reach({"ps:0": f"{ps.address}:7002"}, timeout=10)  # the kernel opens a connection through the bridge
    sink.communicate(timeout=30)
    subprocess.run(["nsenter", f"--net={ps.namespace.path}", "ip", "link", "set", "eth0", "down"], check=True, timeout=10)
    started = time.monotonic()
    with pytest.raises(ClusterStateError, match=r"ps:0 at 10\.213\.\d+\.\d+:7003 cannot be reached through its link .*neighbour"):
        namespaces.reach({"ps:0": f"{ps.address}:7003"}, timeout=3)
    assert time.monotonic() - started < 10  # bounded by the timeout given


def test_netns_delay_is_refused_with_the_reason_when_netem_is_missing(namespaces):
    namespaces.attach("ps:0")
    settings = {"ps:0": {"rate": None, "delay": 0.001}}
    if netns.netem_problem():
        with pytest.raises(ConfigurationError, match="no netem qdisc"):
            namespaces.apply(settings, [])
        assert "no delay: netem is missing" in namespaces.describe()
    else:
        namespaces.apply(settings, [])
        assert "netem" not in namespaces.describe()


def test_netns_links_go_when_their_kernel_dies():
    need_netns()
    before = host_links()
    child = subprocess.Popen([sys.executable, "-c", (
        "import time\nfrom workbench.cluster.network.netns import NamespaceLinks\n"
        "links = NamespaceLinks()\nlinks.attach('ps:0')\nprint('up', flush=True)\ntime.sleep(120)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert read_line(child, 60, "up, once its link was attached").strip() == "up"
        added = host_links() - before
        assert len(added) == 1, added
    finally:
        child.kill()
        child.wait(10)
    wait_for(lambda: not added & host_links(), 10, f"the host end {added} to go with its namespaces")


def test_estimate_profiles_once_and_predicts_links(linked):
    linked.shape("1gbit")
    with pytest.raises(ConfigurationError, match=r"shaped links .*cluster.shape\(None\)"):
        wb.estimate(make_model, linked, 64)
    linked.shape(None)
    overlapped = wb.AsyncPS(overlap=True)
    fast = wb.estimate(make_model, linked, 64, strategy=overlapped, link="10gbit", profile_steps=100)
    parameters = (64 * 32 + 32 + 32 * 10 + 10) * 4
    assert (fast.parameter_bytes, fast.gradient_bytes) == (parameters, parameters)
    assert fast.bottleneck == "the workers' steps" and fast.steps_per_s > 0
    assert 0 < fast.profile.setup_seconds < 30  # a job's set-up after the warm-up job: connected, traced once
    assert fast.seconds_for(500) == pytest.approx(fast.profile.setup_seconds + 500 / fast.steps_per_s)
    slow = wb.estimate(make_model, linked, 64, strategy=overlapped, link="1mbit", profile=fast.profile)
    assert slow.bottleneck.startswith("the ps's link")
    assert 0.9 * 1e6 / 8 / parameters <= slow.steps_per_s < 1e6 / 8 / parameters  # the link, the workers add a little
    more = wb.estimate(make_model, linked, 64, strategy=overlapped, link="10gbit", profile=fast.profile, workers=8)
    assert more.workers == 8 and more.batch_size == 256 and "limited by" in str(more)
    own = wb.estimate(make_model, linked, 64, link="10gbit", profile_steps=100, data=wb.datasets.digits, loss=LOSS)
    assert own.profile.own_data and not fast.profile.own_data  # the job's pipelines, set up and run, are in its figures
    assert (own.parameter_bytes, own.gradient_bytes) == (parameters, parameters) and 0 < own.profile.setup_seconds < 30
    for other in (wb.AsyncPS(transfer="bf16", overlap=True), wb.AsyncPS()):  # another precision; reads after updates
        with pytest.raises(ConfigurationError, match=rf"measured for wb.AsyncPS\(overlap=True\); this estimate asks for "
                                                     rf"{re.escape(other.spelled())}: measure again"):
            wb.estimate(make_model, linked, 64, strategy=other, profile=fast.profile)
    with pytest.raises(TypeError, match=r"transfer= is now strategy=wb.AsyncPS\(transfer=...\)"):
        wb.estimate(make_model, linked, 64, transfer="bf16", profile=fast.profile)
    with pytest.raises(ConfigurationError, match=r"steps_per_epoch=0: pass a whole number of steps >= 1"):
        wb.estimate(make_model, linked, 64, steps_per_epoch=0)
    with pytest.raises(ConfigurationError, match=r"models the ps strategies .*, not wb.AllReduce\(\)"):
        wb.estimate(make_model, linked, 64, strategy="allreduce")
