"""Fixtures for browser tests: a real JupyterLab server and a real headless Chromium (the system
one: nothing is downloaded). Import the fixtures into a test module to use them.

Playwright's CSS selectors pierce open shadow roots, which is where Bokeh renders its widgets.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from conftest import ARTIFACTS, wait_gone

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
START_TIMEOUT = 120.0


@dataclass
class Lab:
    url: str
    token: str
    root_dir: Path
    log_path: Path
    process: subprocess.Popen

    def page_url(self, path: str) -> str:
        return f"{self.url}/{path.lstrip('/')}{'&' if '?' in path else '?'}token={self.token}"

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def jupyter_lab(tmp_path_factory):
    """``jupyter lab`` on 127.0.0.1 with a token, its own dirs, and no news or update toasts."""
    base = tmp_path_factory.mktemp("lab")
    root, settings, runtime, config = (base / n for n in ("root", "settings", "runtime", "config"))
    for d in (root, settings, runtime, config):
        d.mkdir()
    notification = settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    notification.parent.mkdir(parents=True)
    notification.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    token, port = secrets.token_hex(16), _free_port()
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(settings), "JUPYTER_RUNTIME_DIR": str(runtime),
           "JUPYTER_CONFIG_DIR": str(config)}
    command = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
               f"--ServerApp.root_dir={root}"]
    if os.getuid() == 0:
        command.append("--allow-root")
    log_path = base / "lab.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    lab = Lab(f"http://127.0.0.1:{port}", token, root, log_path, process)
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            urllib.request.urlopen(f"{lab.url}/api/status?token={token}", timeout=5).read()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                _stop(process)
                pytest.fail(f"JupyterLab did not start within {START_TIMEOUT:.0f} s:\n{lab.log_tail()}")
            time.sleep(0.5)
    try:
        yield lab
    finally:
        _stop(process)


def _stop(process: subprocess.Popen) -> None:
    """Stop the server and everything it started (kernels, and what the kernels started)."""
    try:
        started = {p.pid for p in psutil.Process(process.pid).children(recursive=True)}
    except psutil.Error:
        started = set()
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)  # the server shuts its kernels down on SIGTERM
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
    leftover = wait_gone(started, timeout=60)
    assert not leftover, f"processes of the JupyterLab server left running: {sorted(leftover)}"


@pytest.fixture
def page(request):
    """A fresh headless Chromium page; a screenshot is kept in test-artifacts/ when the test fails."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium); `make test` does.")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        browser_pid = browser_process_pids()
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            yield page
            if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
                ARTIFACTS.mkdir(exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / f"{request.node.name}-failure.png"), full_page=True)
        finally:
            browser.close()
    assert not wait_gone(browser_pid, timeout=20), "Chromium processes left running"


def browser_process_pids() -> set[int]:
    """Chromium processes started by this test process (its descendants)."""
    return {p.pid for p in psutil.Process().children(recursive=True) if "chrom" in (p.name() or "")}


def run_all_cells(page, lab: Lab, notebook: str, timeout: float = 180.0) -> None:
    """Open ``notebook`` in JupyterLab, start its kernel, and run every cell (Run → Run All Cells)."""
    page.goto(lab.page_url(f"lab/tree/{notebook}"), timeout=timeout * 1000)
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=timeout * 1000)
    accept_kernel_dialog(page)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=timeout * 1000)
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    accept_kernel_dialog(page)


def accept_kernel_dialog(page, wait: float = 5.0) -> None:
    """JupyterLab may ask which kernel to start: take the one it proposes (the notebook's)."""
    dialog = page.locator(".jp-Dialog", has_text="Select Kernel")
    try:
        dialog.wait_for(timeout=wait * 1000)
    except Exception:  # noqa: BLE001 - no dialog: the kernel started by itself
        return
    dialog.locator("button.jp-mod-accept").click()
    dialog.wait_for(state="detached", timeout=30_000)


def output_text(page, text: str, timeout: float = 240.0):
    """Wait until a cell output (not its source) shows ``text``."""
    locator = page.locator(".jp-OutputArea-output", has_text=text).first
    locator.wait_for(timeout=timeout * 1000)
    return locator
