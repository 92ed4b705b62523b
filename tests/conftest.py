"""Fixtures shared by the whole suite.

Integration tests start real ipyparallel engines and real TensorFlow servers on loopback.
Every fixture that starts processes stops them, and ``no_leftover_processes`` proves it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["pytest_jupyter.jupyter_server",  # jp_fetch & co., for the server extension's routes
                  "stuck_tests",  # a test stuck in C is named, its processes ended, the suite goes on
                  "cpu_accounting"]  # each test's CPU-seconds, when run_suite gives the part a cgroup

ARTIFACTS = ROOT / "test-artifacts"

# Registry files of test clusters go to a private directory, not the user's Jupyter runtime dir.
_REGISTRY = tempfile.mkdtemp(prefix="workbench-test-registry-")
os.environ["WORKBENCH_REGISTRY_DIR"] = _REGISTRY
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
for _proxy in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "grpc_proxy"):
    os.environ.pop(_proxy, None)


def pytest_unconfigure(config) -> None:
    """The suite's registry directory goes with the suite (its clusters stopped with their tests)."""
    shutil.rmtree(_REGISTRY, ignore_errors=True)


def pytest_configure(config) -> None:
    """Ctrl-C reaches this process and what it starts, however the suite was launched.

    A shell without job control starts a background command (``make test &``, a CI runner's script)
    with SIGINT and SIGQUIT ignored, and every process inherits that: ``_thread.interrupt_main()``
    then does nothing (the magics' Ctrl-C tests waited out their cells: 60 s, then a loop of remote
    ops that ran for 20 minutes, until faulthandler ended CI), and kernels and engines started here
    would ignore their interrupts too. Python's own handler is put back; children get the default.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """``item.rep_call`` and friends: fixtures can tell whether their test failed (for screenshots)."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


def pytest_runtest_logreport(report):
    """Print a failure's details as soon as it happens, not only in the summary at the end.

    A suite that is cut off later (a CI time limit, the faulthandler backstop) still shows why each
    earlier test failed.
    """
    if report.failed:
        text = report.longreprtext
        if len(text) > 6000:  # a long one keeps its error's first lines (what failed) and its end (where)
            error = max(text.find("\nE "), 0)
            text = f"{text[error:error + 2500]}\n[...]\n{text[-3500:]}"
        sys.__stderr__.write(f"\n---- {report.nodeid} ({report.when}) failed ----\n{text}\n----\n")
        sys.__stderr__.flush()


@pytest.fixture(scope="session")
def registry_dir() -> Path:
    return Path(_REGISTRY)


def descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def wait_gone(pids, timeout: float = 30.0) -> set[int]:
    """Wait until none of ``pids`` runs (zombies count as gone); return those still alive."""
    deadline = time.monotonic() + timeout
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in alive if _running(pid)}
        if alive:
            time.sleep(0.2)
    return alive


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def commands(pids) -> list[list[str]]:
    """The command lines of those of ``pids`` still running (what a leftover-process assertion shows)."""
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid).cmdline())
        except psutil.Error:
            pass
    return found


def warm_children(pid: int | None = None) -> set[int]:
    """The warm processes (``workbench.cluster.launch.warm``) that process ``pid`` (default: this one) started."""
    try:
        children = psutil.Process(pid).children()
    except psutil.Error:
        return set()
    return {p.pid for p in children if "workbench.cluster.launch.warm" in " ".join(p.cmdline())}


@pytest.fixture
def no_leftover_processes():
    """Fails the test if it leaves any process it started (directly or not) running.

    The warm process a stopped cluster leaves for this client's next one is no leftover: it forks nothing
    while kept, and exits with this process (``test_forked_engines.py`` holds it to that).
    """
    from workbench.cluster.launch.fork_launcher import kept_warm

    before = descendants()
    yield
    leftover = wait_gone(descendants() - before - {kept_warm.pid}, timeout=20)
    assert not leftover, f"processes left running: {commands(leftover)}"


def _running_cluster(workers: int, name: str, ps: int = 1):
    import workbench as wb

    # named with this process's pid: `make test` runs two pytest processes side by side (tests/run_suite.py)
    c = wb.Cluster(ps=ps, workers=workers, name=f"{name}-{os.getpid()}", progress=False).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server on loopback with its own store, for the whole session; its URI."""
    from trackers import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    try:
        server.wait_ready()
        yield server.uri
    finally:
        server.stop()


@pytest.fixture
def mlflow_experiment(mlflow_server, request):
    """MLflow's fluent API pointed at the server, in an experiment of this test's own; the experiment."""
    import mlflow

    mlflow.set_tracking_uri(mlflow_server)
    experiment = mlflow.set_experiment(f"{request.node.name}-{os.getpid()}")
    try:
        yield experiment
    finally:
        while mlflow.active_run():
            mlflow.end_run()
        mlflow.set_tracking_uri(None)


@pytest.fixture(scope="session")
def cluster():
    """One running 1 ps + 2 worker cluster shared by the integration tests that only read it."""
    yield from _running_cluster(2, "wb-test-shared")


@pytest.fixture(scope="module")
def cluster3():
    """A 1 ps + 3 worker cluster for a module whose tests may scale it down."""
    yield from _running_cluster(3, "wb-test-three")


@pytest.fixture(scope="module")
def cluster_two_ps():
    """A 2 ps + 2 worker cluster, for variables spread and partitioned over parameter servers."""
    yield from _running_cluster(2, "wb-test-two-ps", ps=2)


def run_tf_client(spec: dict, body: str, timeout: float = 120.0) -> dict:
    """Run ``body`` in a fresh Python connected to ``spec`` as a plain TF client; return its JSON result.

    ``body`` sees ``tf`` and must assign a JSON-serialisable ``result``.
    """
    script = textwrap.dedent(
        """
        import json, sys
        import tensorflow as tf
        spec = json.loads(sys.argv[1])
        tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(spec))
        """
    ) + textwrap.dedent(body) + "\nprint('RESULT ' + json.dumps(result))\n"
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(spec)],
        capture_output=True, text=True, timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"TF client failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def read_line(process: subprocess.Popen, seconds: float, what: str) -> str:
    """The next line ``process`` prints ("" once it exited), waited for at most ``seconds``.

    A child that hangs before printing fails the test at once, naming ``what`` it was to print, instead of
    blocking the test until the suite's timeout.
    """
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(seconds)
    if not line:
        pytest.fail(f"no line from pid {process.pid} within {seconds:.0f} s: it was to print {what} "
                    f"(exit status {process.poll()}, None while it runs)")
    return line[0]


@dataclass(frozen=True)
class BinderEnv:
    """A virtual environment built only from ``binder/``'s files, the way Binder builds its image."""

    python: Path
    workspaces: Path  # where postBuild imported the JupyterLab workspace
    kernels: Path  # a kernelspec "binder" that runs this environment's Python

    @property
    def bin(self) -> Path:
        return self.python.parent


@pytest.fixture(scope="session")
def binder_env(tmp_path_factory) -> BinderEnv:
    """``pip install -r binder/requirements.txt`` then ``binder/postBuild`` (which ends with ``pip check``).

    Installed byte-compiled, as pip does by default: the tutorials' kernels and engines then import TensorFlow
    from its cached bytecode (with ``PYTHONDONTWRITEBYTECODE`` set, as on some machines, nothing is cached later).
    """
    base = tmp_path_factory.mktemp("binder")
    venv = base / "venv"
    built = BinderEnv(venv / "bin" / "python", base / "workspaces", base / "kernels")
    env = {**os.environ, "PATH": f"{built.bin}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(venv),
           "JUPYTERLAB_WORKSPACES_DIR": str(built.workspaces)}
    for command, timeout in [([sys.executable, "-m", "venv", str(venv)], 120),
                             ([str(built.python), "-m", "pip", "install", "--quiet", "-r", "binder/requirements.txt"], 1500),
                             (["bash", "binder/postBuild"], 900)]:
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            pytest.fail(f"building the Binder environment failed at {command}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    spec = built.kernels / "binder"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(built.python), "-m", "workbench.kernel", "-f", "{connection_file}"],  # as the tutorials name it
        "display_name": "Python 3 (Binder environment)", "language": "python"}))
    return built
