"""No port the workbench opens is reachable from another host, by default; and the test can tell.

As root, a second network namespace joined to this one by a veth pair plays the other host (on
addresses of that link only). From there the test tries every TCP port that a kernel started the
workbench's way, its cluster, and a Jupyter server with the workbench extension listen on, over IPv4
and IPv6: all must be refused. The same attack against a bare ``tf.distribute.Server`` runs an op in
it, so the test cannot pass because the attack itself is broken.
"""

import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
import warnings
from pathlib import Path

import netns
import psutil
import pytest
from conftest import ARTIFACTS, read_line
from jupyter_client import KernelManager
from jupyter_helpers import start_kernel, stop_server, wait_for_server

import workbench as wb
from workbench.cluster.process import containment

pytestmark = pytest.mark.cluster


def _shim_env() -> dict:
    """The environment `make lab` gives Jupyter (and so its kernels): the bind shim preloaded."""
    env, problem = containment.preload_env({**os.environ, "LD_PRELOAD": os.environ.get("LD_PRELOAD", "")})
    assert not problem, problem
    return env


def _without_shim() -> dict:
    """This environment without preloaded libraries (`make test` runs the suite with the shim)."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def _listening(root_pids) -> dict[int, tuple[str, str]]:
    """Every TCP port the process trees listen on: {port: (address, process command)}."""
    found = {}
    for root in root_pids:
        try:
            processes = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
        except psutil.Error:
            continue
        for process in processes:
            try:
                for ip, port in containment.listeners(process.pid):
                    found[port] = (ip, " ".join(process.cmdline()))
            except psutil.Error:
                pass
    return found


ATTACK = textwrap.dedent("""
    import json, socket, sys
    reached, silent = [], []
    for host, family in ((sys.argv[1], socket.AF_INET), (sys.argv[2], socket.AF_INET6)):
        for port in json.loads(sys.argv[3]):
            s = socket.socket(family)
            s.settimeout(1)  # on this link a refusal comes within milliseconds
            try:
                s.connect((host, port))
                reached.append(f"{host} {port}")
            except socket.timeout:
                silent.append(f"{host} {port}")
            except OSError:
                pass
            finally:
                s.close()
    print(json.dumps({"reached": reached, "silent": silent}))
""")


def _reachable(peer: netns.Peer, ports) -> list[str]:
    """The ports the peer could connect to. Each probe expects an answer (a refusal when closed): a probe that
    got none says nothing, so the link is checked first and the probes that went unanswered are reported."""
    def probe(ports) -> dict:
        peer.wait_reachable()
        result = peer.run([sys.executable, "-c", ATTACK, peer.host4, peer.host6, json.dumps(sorted(ports))], timeout=300)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    found = probe(ports)
    if found["silent"]:  # once more, those alone, after the link answers a ping again
        again = probe(sorted({int(p.split()[1]) for p in found["silent"]}))
        found = {"reached": found["reached"] + again["reached"], "silent": again["silent"]}
    assert not found["silent"], f"no answer, not even a refusal, from {found['silent']}: the peer's link failed"
    return found["reached"]


# What a client does to open every kind of port: its cluster's TensorFlow servers, its own TensorFlow client's
# port (a job), a dashboard's server. With EVERY_KIND the cluster also forms an all-reduce group and runs every
# task's profiler service: ports of the engines alone, opened the same way whatever started the client, so one
# start mode (FULL_MODE) runs them.
KERNEL_CODE = textwrap.dedent("""
    import keras, time, warnings
    import workbench as wb
    warnings.simplefilter("error", wb.ExposedPortsWarning)  # a port left open fails here too

    def make_model():
        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    cluster = wb.Cluster(ps=1, workers=WORKERS, name="wb-attack-kernel", progress=False).start()
    wb.train(cluster, make_model, wb.datasets.digits, loss, strategy="async-ps", steps=40).wait()  # kernel: TF client
    EVERY_KIND
    wb.serve_dashboard(cluster)

    import json, os
    from workbench.cluster.process import bind_hook, containment
    mine = containment.listeners()  # this process's own ports: its TensorFlow client's among them
    print("CONTAINMENT " + json.dumps({"exposed": containment.exposed(mine), "shim": containment.shim_loaded(),
                                       "preloaded": "workbench-bind-shim" in os.environ.get("LD_PRELOAD", ""),
                                       "hooked": bind_hook.patched_libraries()}), flush=True)
    print("READY", flush=True)
""")
EVERY_KIND = """
    wb.train(cluster, make_model, wb.datasets.digits, loss, strategy="allreduce", steps=20).wait()  # the group's ports
    busy = wb.train(cluster, make_model, wb.datasets.digits, loss, strategy="async-ps", steps=100000)
    for _ in range(1200):  # the capture needs steps running: a loaded machine's set-up can outlast it
        if busy.steps_done >= 5 or busy.state != "running":
            break
        time.sleep(0.1)
    assert busy.steps_done >= 5, (busy.state, busy.steps_done)
    cluster.profile(seconds=1)  # every task's profiler service
    busy.stop()
"""
FULL_MODE = "plain jupyter lab"  # the client whose own port the workbench protects least directly (a hook)


def _kernel_code(mode: str) -> str:
    """KERNEL_CODE for a start mode: every kind of port in FULL_MODE, what the mode changes in the others."""
    full = mode == FULL_MODE
    return (KERNEL_CODE.replace("EVERY_KIND", textwrap.dedent(EVERY_KIND).strip() if full else "pass")
            .replace("WORKERS", "2" if full else "1"))


def _containment(text: str) -> dict:
    """What a client found about its own process (its CONTAINMENT line in ``text``: KERNEL_CODE, KERNEL_CONNECTS)."""
    lines = [line for line in text.splitlines() if line.startswith("CONTAINMENT ")]
    assert lines, f"the client printed no CONTAINMENT line: {text[-2000:]}"
    return json.loads(lines[-1][len("CONTAINMENT "):])


@pytest.fixture
def peer():
    reason = netns.available()
    if reason:
        pytest.skip(f"the attack from another host needs a network namespace: {reason}")
    made = netns.Peer()
    yield made
    made.close()


# How users start the process that becomes a TensorFlow client: (kernelspec or "script", environment)
START_MODES = {
    "make lab": ("python3", _shim_env),  # Jupyter started with the shim preloaded: kernels inherit it
    "plain jupyter lab": ("python3", _without_shim),  # the stock kernel of a server started any other way
    "workbench kernel": ("workbench", _without_shim),  # the tutorials' kernel, from any front end
    "python script.py": ("script", _without_shim),
}


@pytest.fixture(params=sorted(START_MODES))
def contained_kernel(request):
    """A kernel (or script) started one of the ways users start them, that ran a cluster through its kinds of port."""
    kernel_name, environment = START_MODES[request.param]
    env = {**environment(), "TF_CPP_MIN_LOG_LEVEL": "2"}
    code = _kernel_code(request.param)
    if kernel_name == "script":
        yield from _script(env, code)
        return
    manager, client = start_kernel(lambda: KernelManager(kernel_name=kernel_name), env=env)
    try:
        found = _run_kernel_code(client, code)
        yield manager.provisioner.pid, found
        client.execute_interactive("cluster.stop()", timeout=120)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)


def _run_kernel_code(client, code: str) -> dict:
    """``code`` (a KERNEL_CODE) in the kernel behind ``client``: a cluster that opened its ports; what the kernel found."""
    outputs = []
    reply = client.execute_interactive(code, timeout=400, output_hook=lambda m: outputs.append(m["content"]))
    assert reply["content"]["status"] == "ok", (reply["content"], outputs)
    return _containment("".join(o.get("text", "") for o in outputs))


def _script(env: dict, code: str):
    """``python -c code`` (a KERNEL_CODE): runs it, says READY, stops its cluster when its stdin closes."""
    code = code + "\nimport sys\nsys.stdin.read()\ncluster.stop()\n"
    script = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=env, start_new_session=True)
    try:
        lines = []
        for line in script.stdout:
            lines.append(line)
            if line.startswith("READY"):
                break
        assert lines and lines[-1].startswith("READY"), f"the script ended: {lines[-20:]}"
        yield script.pid, _containment("".join(lines))
    finally:
        script.stdin.close()
        try:
            script.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(script.pid, 9)
            script.wait(10)


@pytest.fixture
def contained_server(tmp_path):
    """A Jupyter server with the workbench extension, started the `make lab` way, running a cluster it owns."""
    runtime = tmp_path / "runtime"
    command = [sys.executable, "-m", "jupyter", "server", "--ServerApp.ip=127.0.0.1", "--ServerApp.port=0",
               "--IdentityProvider.token=attack", f"--ServerApp.root_dir={tmp_path}", "--allow-root"]
    server = subprocess.Popen(command, env={**_shim_env(), "JUPYTER_RUNTIME_DIR": str(runtime)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = wait_for_server(runtime, server)

        def call(method: str, path: str, body=None):
            request = urllib.request.Request(f"{url}/{path}", method=method, headers={"Authorization": "token attack"},
                                             data=json.dumps(body).encode() if body is not None else None)
            with urllib.request.urlopen(request, timeout=300) as response:
                return json.loads(response.read() or b"null")

        call("POST", "workbench/api/clusters", {"name": "wb-attack-panel", "ps": 1, "workers": 1})
        call("GET", "workbench/api/clusters/wb-attack-panel/plots")  # the owner serves the dashboards too
        yield server
        call("DELETE", "workbench/api/clusters/wb-attack-panel")
    finally:
        stop_server(server)


def _attack(peer, roots, name: str) -> tuple[dict, list[str]]:
    """Every TCP port of the process trees ``roots``, tried from ``peer``; what it found goes to test-artifacts."""
    ports = _listening(roots)
    reached = _reachable(peer, ports)
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / f"exposure-{name}.json").write_text(json.dumps(
        {"probed_from": [peer.peer4, peer.peer6], "targets": [peer.host4, peer.host6], "reached": reached,
         "ports": {str(port): {"address": ip, "process": command} for port, (ip, command) in sorted(ports.items())}},
        indent=2))
    return ports, reached


def test_no_port_of_a_kernel_or_its_cluster_is_reachable_from_another_host(peer, contained_kernel, request,
                                                                           no_leftover_processes):
    pid, found = contained_kernel
    mode = request.node.callspec.id
    ports, reached = _attack(peer, [pid], mode.replace(" ", "-").replace(".", "-"))
    tensorflow = [p for p, (_, command) in ports.items() if "engine_main" in command]
    if mode == FULL_MODE:
        assert len(ports) >= 10 and len(tensorflow) >= 6, ports  # TF servers, all-reduce, profiler: it all ran
    else:
        assert len(ports) >= 6 and len(tensorflow) >= 2, ports  # both TF servers, the kernel's own ports
    assert reached == [], ports
    # how the client's own TensorFlow port came to listen on loopback, as the process saw it (KERNEL_CODE turns
    # an ExposedPortsWarning into an error, so none was given either)
    assert found["exposed"] == [], found
    if START_MODES[mode][1] is _shim_env or START_MODES[mode][0] == "workbench":
        assert found["shim"], found  # `make lab` preloads the shim, and the workbench kernel preloads it itself
    else:  # no LD_PRELOAD, no instructions: the workbench re-pointed TensorFlow's bind when it was imported
        assert not found["preloaded"] and any("libtensorflow" in path for path in found["hooked"]), found


def test_no_port_of_the_jupyter_server_or_its_panel_cluster_is_reachable_from_another_host(
        peer, contained_server, no_leftover_processes):
    ports, reached = _attack(peer, [contained_server.pid], "server")
    assert len(ports) >= 5 and any("engine_main" in command for _, command in ports.values()), ports
    assert reached == [], ports


def test_the_same_attack_runs_code_in_a_bare_tensorflow_server(peer, tmp_path):
    port_holder = __import__("socket").socket()
    port_holder.bind(("127.0.0.1", 0))
    port = port_holder.getsockname()[1]
    port_holder.close()
    bare = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time, tensorflow as tf
        server = tf.distribute.Server(tf.train.ClusterSpec({{"worker": ["localhost:{port}"]}}), job_name="worker",
                                      task_index=0)
        print("up", flush=True)
        time.sleep(300)
    """)], stdout=subprocess.PIPE, text=True, env={**_without_shim(), "TF_CPP_MIN_LOG_LEVEL": "3"})
    try:
        assert read_line(bare, 180, "up, once its server listened").strip() == "up"
        assert _reachable(peer, [port]) == [f"{peer.host4} {port}", f"{peer.host6} {port}"]
        attack = textwrap.dedent(f"""
            import tensorflow as tf
            tf.compat.v1.disable_eager_execution()
            with tf.device("/job:worker/task:0"):
                answer = tf.constant(6) * 7
            with tf.compat.v1.Session("grpc://{peer.host4}:{port}") as session:
                print("ran on the victim:", session.run(answer))
        """)
        result = peer.run([sys.executable, "-c", attack], timeout=300)
        assert "ran on the victim: 42" in result.stdout, result.stderr[-2000:]
    finally:
        bare.kill()
        bare.wait(10)


def test_local_tensorflow_ports_listen_on_loopback_and_the_check_agrees(cluster):
    for record in cluster.tasks:
        mine = containment.listeners(record.pid)
        assert mine and not containment.exposed(mine), (record.name, mine)
        assert all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for ip, _ in mine), (record.name, mine)
    with warnings.catch_warnings():
        warnings.simplefilter("error", wb.ExposedPortsWarning)
        assert cluster.check_exposure() == []


def test_without_the_shim_the_open_ports_are_named_with_what_to_do(tmp_path, no_leftover_processes):
    env = {"WORKBENCH_BIND_SHIM": str(tmp_path / "no-such-shim.so"), "LD_PRELOAD": ""}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():  # the client and its engines both look for the shim, and find none
            patch.setenv(key, value)
        with pytest.warns(wb.ExposedPortsWarning) as caught:
            cluster = wb.Cluster(ps=1, workers=1, progress=False).start()
        try:
            # the one ExposedPortsWarning (pytest.warns records every warning: a garbage-collected socket's too)
            (message,) = [str(w.message) for w in caught if issubclass(w.category, wb.ExposedPortsWarning)]
            for record in cluster.tasks:
                assert f"{record.name} [::]:{record.address.rsplit(':', 1)[1]}" in message
            assert "no-such-shim.so" in message and "start the cluster again" in message and "firewall" in message
        finally:
            cluster.stop()


KERNEL_CONNECTS = """
    import warnings, workbench as wb
    from workbench.cluster.process import containment
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with wb.Cluster(ps=0, workers=1, progress=False) as cluster:
            cluster.connect()
            mine = containment.listeners()
    import json
    from workbench.cluster.process import bind_hook
    print("CONTAINMENT " + json.dumps({"warnings": [str(w.message) for w in caught if w.category is wb.ExposedPortsWarning],
                                       "exposed": containment.exposed(mine), "hooked": bind_hook.patched_libraries()}))
"""


def _kernel_like(env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(KERNEL_CONNECTS)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _containment(proc.stdout)


def test_a_process_that_cannot_be_protected_is_told_which_port_is_open_and_why(tmp_path, no_leftover_processes):
    plain = _kernel_like({**_without_shim(), "WORKBENCH_BIND_SHIM": str(tmp_path / "no-such-shim.so")})
    assert len(plain["exposed"]) == 1 and plain["hooked"] == []
    port = plain["exposed"][0][1]
    (message,) = [w for w in plain["warnings"] if "this process's TensorFlow port" in w]
    assert f"[::]:{port}" in message and "no-such-shim.so" in message and "firewall" in message


def test_an_engine_started_by_another_launcher_loads_the_shim_itself(monkeypatch, no_leftover_processes):
    """As under Slurm, MPI or SSH: ipyparallel starts the workbench's engine command with an environment of its own."""
    import ipyparallel as ipp

    from workbench.cluster.launch import engine_side
    from workbench.cluster.launch.engine_main import ENGINE_MAIN

    monkeypatch.delenv("LD_PRELOAD", raising=False)  # `make test` runs the suite with the shim: the engine must load it
    ipp_cluster = ipp.Cluster(engines="local", n=0, controller_ip="127.0.0.1", cluster_id="wb-test-foreign-launcher",
                              log_level=40)
    ipp_cluster.start_controller_sync()
    ipp_cluster.start_engines_sync(1, engine_cmd=list(ENGINE_MAIN))
    client = ipp_cluster.connect_client_sync()
    try:
        client.wait_for_engines(1, timeout=120)
        engine = client[client.ids[0]]
        pid = engine.apply_sync(os.getpid)
        assert "workbench-bind-shim" in Path(f"/proc/{pid}/maps").read_text()  # it ran itself again, with the shim
        info = engine.apply_sync(engine_side.probe, "127.0.0.1")
        port = engine.apply_sync(engine_side.prepare_tensorflow, [])["port"]
        started = engine.apply_sync(engine_side.start_server, {"worker": [f"{info['address']}:{port}"]}, "worker", 0)
        assert started["ok"], started
        assert containment.exposed(containment.listeners(pid)) == []
    finally:
        client.close()
        ipp_cluster.stop_cluster_sync()


REACH_SERVER = textwrap.dedent("""
    import sys, urllib.request
    with urllib.request.urlopen(f"http://{sys.argv[1]}:{sys.argv[2]}/api/status?token=binder", timeout=20) as answer:
        print(answer.status)
""")


def test_binder_serves_the_hub_and_keeps_its_kernels_ports_closed(peer, binder_env, tmp_path, no_leftover_processes):
    """``binder/start`` exactly as repo2docker runs it: the server listens on every interface (the hub's proxy
    reaches it from outside the container); the tutorials' kernel and its cluster listen on loopback only."""
    from jupyter_client import BlockingKernelClient

    runtime = tmp_path / "runtime"
    holder = __import__("socket").socket()
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    holder.close()
    env = {**_without_shim(), "PATH": f"{binder_env.bin}{os.pathsep}{os.environ['PATH']}", "JUPYTER_RUNTIME_DIR": str(runtime),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "TF_CPP_MIN_LOG_LEVEL": "2"}
    command = ["bash", str(Path(__file__).resolve().parents[2] / "binder" / "start"), "jupyter", "lab", "--ip=0.0.0.0",
               f"--port={port}", "--no-browser", "--IdentityProvider.token=binder", f"--ServerApp.root_dir={tmp_path}",
               "--allow-root"]
    server = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    kernel = None
    try:
        deadline = time.monotonic() + 180
        while not list(runtime.glob("jpserver-*.json")):
            assert server.poll() is None and time.monotonic() < deadline, "binder/start jupyter lab did not start"
            time.sleep(0.2)
        # its own port: the one asked for, unless another process took it meanwhile (the server then takes the next)
        port = int(json.loads(next(runtime.glob("jpserver-*.json")).read_text())["port"])
        while True:  # on 127.0.0.1, whatever address the server writes in its runtime file
            try:
                __import__("socket").create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "binder/start jupyter lab did not listen"
                time.sleep(0.2)

        def call(method: str, path: str, body=None):
            request = urllib.request.Request(f"http://127.0.0.1:{port}/{path}", method=method,
                                             headers={"Authorization": "token binder"},
                                             data=json.dumps(body).encode() if body is not None else None)
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.loads(response.read() or b"null")

        reached = peer.run([sys.executable, "-c", REACH_SERVER, peer.host4, str(port)], timeout=120)
        assert reached.stdout.strip() == "200", f"the hub could not reach the server: {reached.stderr[-2000:]}"
        kernel = call("POST", "api/kernels", {"name": "workbench"})["id"]  # the kernel the tutorials name
        client = BlockingKernelClient(connection_file=str(runtime / f"kernel-{kernel}.json"))
        client.load_connection_file()
        # without a manager the client judges the kernel alive by its heartbeat, 1 s by default: the two busy
        # halves of the suite once delayed one past that while the kernel started ("Kernel died before replying")
        client.hb_channel.time_to_dead = 10.0
        client.start_channels()
        try:
            _run_kernel_code(client, _kernel_code("workbench kernel"))
            kernels = [p for p in psutil.Process(server.pid).children() if "workbench.kernel" not in " ".join(p.cmdline())]
            assert any("workbench-bind-shim" in Path(f"/proc/{p.pid}/maps").read_text() for p in kernels), (
                "the workbench kernel runs without the bind shim")
            ports, reached = _attack(peer, [server.pid], "binder")
            assert reached == [f"{peer.host4} {port}"], ports  # the server, and nothing else
            client.execute_interactive("cluster.stop()", timeout=120)
        finally:
            client.stop_channels()
    finally:
        if kernel is not None:
            try:
                call("DELETE", f"api/kernels/{kernel}")
            except OSError:
                pass
        stop_server(server)
