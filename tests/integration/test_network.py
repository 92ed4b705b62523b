"""Emulated links between tasks: the user-space relay, wb.Cluster(network=...), cluster.shape(...) and %wb shape."""

import os
import socket
import subprocess
import sys
import threading
import time

import keras
import psutil
import pytest
from IPython.core.interactiveshell import InteractiveShell
from training_helpers import LOSS, make_model, wait_for

import workbench as wb
from workbench.cluster.shaping import UserSpaceLinks
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
    wait_for(lambda: relay.stats()["sent"].get("ps:0 in", 0) == slow.received, 10, "the relay to drain")
    assert slow.received < 2.0 * 2.5e6 * 1.5, f"{slow.received} bytes in 2 s through a 2.5 MB/s link"
    assert relay.stats()["sent"]["worker:0 out"] == slow.received, "the sender was not identified as worker:0"

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
        "import time\nfrom workbench.cluster.shaping import UserSpaceLinks\n"
        "print(UserSpaceLinks().pid, flush=True)\ntime.sleep(120)")], stdout=subprocess.PIPE, text=True)
    try:
        relay_pid = int(child.stdout.readline())
        assert psutil.pid_exists(relay_pid)
    finally:
        child.kill()
        child.wait(10)
    wait_for(lambda: not psutil.pid_exists(relay_pid) or psutil.Process(relay_pid).status() == psutil.STATUS_ZOMBIE,
             10, f"the relay (pid {relay_pid}) to exit after its kernel was killed")


@pytest.fixture(scope="module")
def linked():
    cluster = wb.Cluster(ps=1, workers=2, name="wb-test-links", network="auto", progress=False).start()
    yield cluster
    cluster.stop()


def test_every_task_is_reached_through_its_link(linked):
    relay = psutil.Process(linked._links.pid)
    listening = {c.laddr.port for c in relay.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    for record in linked.tasks:
        assert int(record.address.rsplit(":", 1)[1]) in listening, f"{record.name} is not behind the relay"
    assert "links: user-space links" in str(linked.status())
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
        described = linked.shape("4mbit")  # 0.5 MB/s for the ps's card
        assert described.endswith("all: 4 Mbit/s")
        time.sleep(0.5)  # what was in flight drains
        shaped = ps_bytes_out(linked, 1.5)
        assert shaped < 1.5 * 0.5e6 * 1.5, f"{shaped} bytes from the ps in 1.5 s at 4 Mbit/s"
        assert free > 3 * shaped, f"unshaped {free} bytes vs shaped {shaped} bytes in 1.5 s"
        assert linked.shape(None).endswith("unshaped")
        assert job.state == "running"
        changes = [e.shaping for e in linked.telemetry.since(0).events if isinstance(e, LinkEvent)]
        assert changes[-2:] == ["all: 4 Mbit/s", "unshaped"]  # the dashboard's timeline shades between them
    finally:
        job.stop()
        job.wait(120)
    stats = linked.link_stats()["sent"]
    for task in ("ps:0", "worker:0", "worker:1"):
        assert stats.get(f"{task} out", 0) > 0 and stats.get(f"{task} in", 0) > 0, f"{task} not identified: {stats}"


def test_rules_show_in_status_and_a_task_keeps_its_link_when_re_hosted(linked):
    linked.shape("100mbit", delay="1ms", between="ps-worker")
    linked.shape("10mbit", between="worker:1")
    status = str(linked.status())
    assert "ps-worker: 100 Mbit/s, delay 1 ms; worker:1: 10 Mbit/s" in status
    address = linked.task("worker:1").address
    linked.replace_task("worker:1")
    assert linked.task("worker:1").address == address
    job = wb.train(linked, make_model, wb.datasets.digits, LOSS, steps=100, batch_size=64, telemetry=False)
    job.wait(120)
    assert job.state == "done", job.error
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
    shell.run_line_magic("wb", f"shape 1gbit --delay 0.2ms --between ps --name {linked.name}")
    shell.run_line_magic("wb", f"shape --name {linked.name}")
    shell.run_line_magic("wb", f"shape off --name {linked.name}")
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("ps: 1 Gbit/s, delay 0.2 ms") and out[1] == out[0] and out[2].endswith("unshaped")


def test_stopping_the_cluster_stops_its_relay():
    cluster = wb.Cluster(ps=1, workers=1, name="wb-test-links-stop", network="1gbit", progress=False).start()
    pid = cluster._links.pid
    assert "all: 1 Gbit/s" in cluster.network
    cluster.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_estimate_profiles_once_and_predicts_links(linked):
    linked.shape("1gbit")
    with pytest.raises(ConfigurationError, match=r"shaped links .*cluster.shape\(None\)"):
        wb.estimate(make_model, linked, 64)
    linked.shape(None)
    fast = wb.estimate(make_model, linked, 64, link="10gbit", profile_steps=100)
    parameters = (64 * 32 + 32 + 32 * 10 + 10) * 4
    assert (fast.parameter_bytes, fast.gradient_bytes) == (parameters, parameters)
    assert fast.bottleneck == "the workers' steps" and fast.steps_per_s > 0
    slow = wb.estimate(make_model, linked, 64, link="1mbit", profile=fast.profile)
    assert slow.bottleneck.startswith("the ps's link")
    assert slow.steps_per_s == pytest.approx(1e6 / 8 / parameters)
    more = wb.estimate(make_model, linked, 64, link="10gbit", profile=fast.profile, workers=8)
    assert more.workers == 8 and more.batch_size == 256 and "limited by" in str(more)
    with pytest.raises(ConfigurationError, match="measured for strategy='async-ps', transfer='fp32'"):
        wb.estimate(make_model, linked, 64, transfer="bf16", profile=fast.profile)
    with pytest.raises(ConfigurationError, match="models strategy='async-ps' and 'sync-ps'"):
        wb.estimate(make_model, linked, 64, strategy="allreduce")
