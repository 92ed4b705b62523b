"""Browser-test infrastructure: a real JupyterLab server driven by the system's headless Chromium.

Fixtures:
- ``jupyter_lab`` (module scope) yields a :class:`Lab`: ``jupyter lab`` on 127.0.0.1 with a random
  token and its own root, settings, workspaces, runtime, config and data dirs under tmp.
- ``browser`` yields a playwright ``BrowserContext``: ``/usr/bin/chromium`` headless with a fresh
  profile dir (test tools never download a browser).
- ``page`` yields the page of ``browser``; when the test fails, its screenshot and console log are kept
  as ``test-artifacts/<test>-failure.png`` and ``<test>-console.log``.
Helpers: :func:`run_notebook_in_lab` (open a notebook, run every cell; one that does not finish fails with
its kernel's stacks), :func:`cell_output` and
:func:`cell_output_text`.

Each fixture's teardown checks that no process it started is left, and kills (then reports) any that is.

Playwright's CSS selectors pierce open shadow roots: Bokeh 3 draws its canvases inside them, so
``cell_output(panel, i).locator("canvas")`` finds them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlencode

import psutil
import pytest
import stacks
from conftest import ARTIFACTS, wait_gone

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync")
VIEWPORT = {"width": 1400, "height": 900}
LAB_START_TIMEOUT = 90.0

# No news or update checks and no toasts over the page; every cell attached to the DOM (the default
# windowing leaves offscreen cells, and their outputs, unrendered until they are scrolled to); no autosave: a test saves
# when it means to (a save that met an autosave of the same notebook under load found the file's hash changed, and
# waited on JupyterLab's "File Changed" dialog until the test's timeout).
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
}


@dataclass(frozen=True)
class Lab:
    """A running ``jupyter lab``: ``url`` has no trailing slash; files under ``root_dir`` are served."""

    url: str
    token: str
    root_dir: Path
    log_path: Path
    pid: int
    registry: Path  # its kernels' clusters (WORKBENCH_REGISTRY_DIR): another process here that attaches uses it too

    def url_for(self, path: str = "", **query: str) -> str:
        """The full URL of ``path`` on this server, token included: ``lab.url_for("lab/tree/a.ipynb")``."""
        return f"{self.url}/{path.lstrip('/')}?{urlencode({**query, 'token': self.token})}"

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def kernel_connection_file(self, kernel_id: str) -> Path:
        """Where the server wrote the connection file of its kernel ``kernel_id`` (its runtime dir, beside ``root_dir``)."""
        return self.root_dir.parent / "runtime" / f"kernel-{kernel_id}.json"

    def api(self, path: str, method: str = "GET", timeout: float = 10.0) -> bytes:
        request = urllib.request.Request(f"{self.url}/{path.lstrip('/')}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()


# ---------------------------------------------------------------------------------------------- the server

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _lab_dirs(base: Path) -> dict[str, Path]:
    dirs = {name: base / name for name in ("root", "settings", "workspaces", "runtime", "config", "data", "ipython",
                                           "registry")}
    for path in dirs.values():
        path.mkdir()
    for name, values in LAB_SETTINGS.items():
        settings_file = dirs["settings"] / name
        settings_file.parent.mkdir(parents=True, exist_ok=True)
        settings_file.write_text(json.dumps(values))
    return dirs


def _start_lab(dirs: dict[str, Path], log_path: Path, token: str, python: str | Path = sys.executable,
               wrapper: tuple[str, ...] = (), base_env: dict | None = None) -> tuple[subprocess.Popen, Lab]:
    port = _free_port()
    command = [*wrapper,
        str(python), "-m", "jupyter", "lab", "--no-browser",
        "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={dirs['root']}",
        f"--LabApp.user_settings_dir={dirs['settings']}", f"--LabApp.workspaces_dir={dirs['workspaces']}",
        "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: run and watch notebooks without menus
    ]
    if os.getuid() == 0:
        command.append("--allow-root")
    # Private Jupyter/IPython dirs: no user config, kernels or startup files leak into the test. A private registry:
    # the panel lists the clusters of this server's kernels, not those the test process runs (its session cluster).
    env = {**(os.environ if base_env is None else base_env),
           "PATH": f"{Path(python).parent}{os.pathsep}{os.environ['PATH']}",  # its own scripts first
           "JUPYTERLAB_SETTINGS_DIR": str(dirs["settings"]),
           "JUPYTERLAB_WORKSPACES_DIR": str(dirs["workspaces"]), "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
           "JUPYTER_CONFIG_DIR": str(dirs["config"]), "JUPYTER_DATA_DIR": str(dirs["data"]),
           "IPYTHONDIR": str(dirs["ipython"]), "WORKBENCH_REGISTRY_DIR": str(dirs["registry"])}
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env, cwd=dirs["root"], start_new_session=True)
    return process, Lab(f"http://127.0.0.1:{port}", token, dirs["root"], log_path, process.pid, dirs["registry"])


def _wait_until_serving(lab: Lab, process: subprocess.Popen, timeout: float) -> bool:
    """True once ``/api/status`` answers with the token; False if the server exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            json.loads(lab.api("api/status", timeout=5))
            return True
        except OSError:  # refused, reset, not yet authorised, or 5xx while starting
            time.sleep(0.25)
    return False


def _process_tree(pid: int) -> list[psutil.Process]:
    """``pid`` and its descendants now (kernels run in sessions of their own, so a process group is not enough)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _kill_leftovers(processes: list[psutil.Process], timeout: float) -> list[str]:
    """Wait for ``processes`` to end; kill those that do not. Returns what had to be killed."""
    by_pid = {p.pid: p for p in processes}
    leftover = wait_gone(by_pid, timeout=timeout)
    killed = []
    for pid in leftover:
        try:
            killed.append(f"{pid}: {' '.join(by_pid[pid].cmdline())[:200]}")
            by_pid[pid].kill()  # psutil refuses if the pid was reused by another process
        except psutil.Error:
            pass
    wait_gone(leftover, timeout=10)
    return killed


def _stop_lab(lab: Lab, process: subprocess.Popen) -> list[str]:
    """Stop the server as a user would (it shuts its kernels down first), then make sure of it."""
    started = _process_tree(process.pid)
    if process.poll() is None:
        try:
            lab.api("api/shutdown", method="POST", timeout=30)
        except OSError:  # the server may drop the connection while it stops
            pass
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
    return _kill_leftovers([p for p in started if p.pid != process.pid], timeout=30)


@contextlib.contextmanager
def running_lab(base: Path, python: str | Path = sys.executable, prepare=None, wrapper: tuple[str, ...] = (),
                base_env: dict | None = None):
    """``jupyter lab`` of ``python`` with private dirs under ``base``; ``prepare(dirs)`` runs before it starts.

    ``wrapper`` runs first and must end with ``exec "$@"`` (as Binder's ``binder/start``); ``base_env`` replaces
    this process's environment as the one the server starts from.
    """
    dirs, log_path, token = _lab_dirs(base), base / "lab.log", secrets.token_hex(16)
    if prepare is not None:
        prepare(dirs)
    for attempt in range(3):
        process, lab = _start_lab(dirs, log_path, token, python, wrapper, base_env)
        if _wait_until_serving(lab, process, LAB_START_TIMEOUT):
            break
        _stop_lab(lab, process)
        port_taken = "is already in use" in lab.log_tail(20)  # lost the race for the free port: try another
        if not port_taken or attempt == 2:
            pytest.fail(f"JupyterLab did not answer on {lab.url} within {LAB_START_TIMEOUT:.0f} s "
                        f"(exit code {process.returncode}); log {log_path}:\n{lab.log_tail()}")
    try:
        yield lab
    finally:
        killed = _stop_lab(lab, process)
    assert not killed, f"JupyterLab left processes running (killed now): {killed}\n{lab.log_tail(20)}"


@pytest.fixture(scope="module")
def jupyter_lab(tmp_path_factory):
    """``jupyter lab`` on 127.0.0.1 with a token, private dirs, no toasts; stopped with every kernel it started."""
    with running_lab(tmp_path_factory.mktemp("lab")) as lab:
        yield lab


# --------------------------------------------------------------------------------------------- the browser

def _chromium_tree(profile: Path) -> list[psutil.Process]:
    """Our Chromium for ``profile`` (found by its --user-data-dir) and every process it started."""
    flag = f"--user-data-dir={profile}"
    tree = []
    for process in psutil.Process().children(recursive=True):
        try:
            if flag in process.cmdline() and not any(a.startswith("--type=") for a in process.cmdline()):
                tree += _process_tree(process.pid)
        except psutil.Error:
            continue
    return tree


@pytest.fixture
def browser(tmp_path):
    """The system Chromium, headless, with a fresh profile under tmp: a playwright ``BrowserContext``."""
    from playwright.sync_api import sync_playwright

    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium); "
                    "`make test` does it when run as root.")
    profile = tmp_path / "chromium-profile"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with sync_playwright() as playwright:
        started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]  # the driver
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, args=list(CHROMIUM_ARGS), headless=True, viewport=VIEWPORT,
            timeout=60_000)
        try:
            yield context
        finally:
            started += _chromium_tree(profile)  # taken last: renderers come and go
            context.close()
    killed = _kill_leftovers(started, timeout=20)
    assert not killed, f"Chromium or the playwright driver was left running (killed now): {killed}"


@pytest.fixture
def page(browser, request):
    """A page in ``browser``; on failure its screenshot and console log go to test-artifacts/."""
    page = browser.pages[0] if browser.pages else browser.new_page()
    page.set_default_navigation_timeout(60_000)
    # an action (a click, a fill) waits this long for the page to take it: on a CI machine running both halves of
    # the suite, the panel's Start button was still "performing click action" after Playwright's default 30 s
    page.set_default_timeout(60_000)
    console: list[str] = []
    page.on("console", lambda message: console.append(f"{message.type}: {message.text}"))
    page.on("pageerror", lambda error: console.append(f"pageerror: {error}"))
    yield page
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        _keep_failure_artifacts(page, request.node.name, console)
    if "jupyter_lab" in request.fixturenames:  # the module's server outlives the test: not so its kernels
        shut_down_kernels(request.getfixturevalue("jupyter_lab"))


def shut_down_kernels(lab: Lab) -> None:
    """Shut down every kernel of ``lab``, as closing a test's notebooks would: a test that failed half-way leaves
    no kernel training beside the next test (one that did left a 100,000-step job starving the next notebook)."""
    for kernel in json.loads(lab.api("api/kernels")):
        try:
            lab.api(f"api/kernels/{kernel['id']}", method="DELETE", timeout=60)
        except urllib.error.HTTPError as error:
            if error.code != 404:  # 404: it went meanwhile
                raise


def _keep_failure_artifacts(page, test_name: str, console: list[str]) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    stem = re.sub(r"[^\w.-]+", "_", test_name)
    (ARTIFACTS / f"{stem}-console.log").write_text("\n".join(console) + "\n")
    try:
        page.screenshot(path=str(ARTIFACTS / f"{stem}-failure.png"), full_page=True, timeout=15_000)
    except Exception as error:  # noqa: BLE001 - a crashed page must not hide the test's own failure
        print(f"no failure screenshot: {error}")


# ---------------------------------------------------------------------------------------- notebook helpers

# Page-side helpers, given the notebook's path: the open panel, its kernel, its code cells.
_JS_PANEL = """
const app = window.jupyterapp;
const panel = app && [...app.shell.widgets("main")].find((w) => w.context && w.context.path === path);
const kernel = panel && panel.sessionContext.session && panel.sessionContext.session.kernel;
const codeCells = panel && panel.context.isReady ? [...panel.content.model.cells].filter((c) => c.type === "code") : [];
"""

_JS_KERNEL_READY = "(path) => {" + _JS_PANEL + """
  if (document.querySelector(".jp-Dialog")) return "dialog";
  if (panel && panel.context.isReady && panel.sessionContext.isReady && kernel
      && kernel.connectionStatus === "connected" && kernel.status === "idle") return panel.id;
  return null;
}"""

_JS_RUN_ALL = "(path) => {" + _JS_PANEL + """
  app.shell.activateById(panel.id);
  window.__workbenchRunAll = {done: false};
  app.commands.execute("notebook:run-all-cells").then(
    (ok) => { window.__workbenchRunAll = {done: true, ok: ok !== false}; },
    (error) => { window.__workbenchRunAll = {done: true, ok: false, error: String(error)}; });
}"""

_JS_RUN_FINISHED = "(path) => {" + _JS_PANEL + """
  return Boolean(window.__workbenchRunAll && window.__workbenchRunAll.done) && kernel && kernel.status === "idle";
}"""

_JS_STATE = "(path) => {" + _JS_PANEL + """
  return {
    kernel: kernel ? kernel.status : null,
    run: window.__workbenchRunAll || null,
    counts: codeCells.map((c) => c.executionCount),
    errors: codeCells.flatMap((c, i) => [...Array(c.outputs.length).keys()].map((k) => c.outputs.get(k).toJSON())
      .filter((o) => o.output_type === "error")
      .map((o) => `code cell ${i}: ${o.ename}: ${o.evalue}\\n${(o.traceback || []).join("\\n")}`)),
  };
}"""

# the panel's figures, job names and task lines that take more than one line, or more width than their card
JS_WRAPPED = """() => [...document.querySelectorAll(
    ".wb-card .wb-rate, .wb-card .wb-jobname, .wb-card .wb-name, .wb-card .wb-tasks td")]
  .filter((e) => e.getClientRects().length > 1 || e.getBoundingClientRect().height > 2.2 * parseFloat(getComputedStyle(e).fontSize)
                 || e.getBoundingClientRect().right > e.closest(".wb-card").getBoundingClientRect().right + 1)
  .map((e) => e.textContent)"""

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


COMMAND_SECONDS = 180.0  # a JupyterLab command's wait: one that waits on a dialog never ends by itself


def execute_command(page, command: str, args: dict | None = None, seconds: float = COMMAND_SECONDS) -> None:
    """Run JupyterLab's ``command`` in the page and wait for it, at most ``seconds``; then fail naming the dialogs the
    page shows. What it returns (often a widget) is not sent back: Playwright would copy its whole object graph, which
    ran past a test's 600 s under load once."""
    done = page.evaluate("""([command, args, ms]) => Promise.race([
        window.jupyterapp.commands.execute(command, args).then(() => true),
        new Promise((resolve) => setTimeout(() => resolve(false), ms))])""", [command, args or {}, seconds * 1000])
    if not done:
        dialogs = page.locator(".jp-Dialog").all_inner_texts()
        raise AssertionError(f"JupyterLab's {command} had not finished after {seconds:.0f} s; dialogs shown: {dialogs}")


def write_notebook(lab: Lab, name: str, cells: list[str]) -> str:
    """A notebook of code ``cells`` (Python 3 kernel) in the lab's root; returns its relative path."""
    import nbformat

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, lab.root_dir / name)
    return name


def run_notebook_in_lab(page, lab: Lab, relative_path: str, timeout: float = 240.0):
    """Open ``relative_path`` (under ``lab.root_dir``) in JupyterLab and run all its cells, like Run → Run All Cells.

    Waits for the kernel, runs every cell, and returns the notebook panel's locator once the kernel is
    idle again and every code cell has an execution count. A cell that raises fails the test with its
    traceback; so does running out of ``timeout`` seconds (with the notebook's state and the server log).
    Widgets and plots render after that: wait for them with playwright's ``expect``.
    """
    from playwright.sync_api import Error as PlaywrightError

    deadline = time.monotonic() + timeout

    def left_ms() -> float:
        return max(1.0, deadline - time.monotonic()) * 1000

    def fail(why: str):
        glance, dumps = stacks.report(stacks.kernels_of(lab.pid))  # first: where a kernel that runs nothing waits
        try:
            state = page.evaluate(_JS_STATE, relative_path)
        except PlaywrightError as error:
            state = f"unknown ({error})"
        pytest.fail(f"{why} ({relative_path}); {glance}; notebook state: {state}\nserver log:\n{lab.log_tail(30)}"
                    f"\n{dumps}")

    page.goto(lab.url_for(f"lab/tree/{quote(relative_path)}"), wait_until="domcontentloaded", timeout=left_ms())
    try:
        while True:
            ready = page.wait_for_function(_JS_KERNEL_READY, arg=relative_path, polling=250, timeout=left_ms())
            if ready.json_value() != "dialog":
                panel_id = ready.json_value()
                break
            # "Select Kernel" (a notebook without kernelspec): take what JupyterLab proposes.
            page.locator(".jp-Dialog .jp-mod-accept").click(timeout=left_ms())
            page.locator(".jp-Dialog").wait_for(state="detached", timeout=left_ms())
    except PlaywrightError:
        fail(f"the notebook or its kernel was not ready within {timeout:.0f} s")
    page.evaluate(_JS_RUN_ALL, relative_path)
    try:
        page.wait_for_function(_JS_RUN_FINISHED, arg=relative_path, polling=250, timeout=left_ms())
    except PlaywrightError:
        fail(f"running all cells did not finish within {timeout:.0f} s")
    state = page.evaluate(_JS_STATE, relative_path)
    if state["errors"]:
        pytest.fail(f"{relative_path} raised:\n" + _ANSI.sub("", "\n\n".join(state["errors"])))
    if not state["run"]["ok"] or None in state["counts"]:
        fail("not every cell ran")
    return page.locator(f"[id='{panel_id}']")


def cell_output(panel, index: int):
    """The output area of cell ``index`` (counting every cell, markdown included) of a notebook panel."""
    return panel.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-OutputArea")


def cell_output_text(panel, index: int, timeout: float = 30.0) -> str:
    """The visible text of cell ``index``'s outputs."""
    return cell_output(panel, index).inner_text(timeout=timeout * 1000)
