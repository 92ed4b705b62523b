"""JupyterLab of the Binder environment opens the first tutorial with the Workbench panel visible."""

import os
import shutil
from pathlib import Path

import pytest
from conftest import ARTIFACTS, ROOT

from .conftest import running_lab

pytestmark = pytest.mark.browser


def test_binder_opens_the_first_tutorial_with_the_panel_visible(binder_env, tmp_path, page):
    def prepare(dirs):
        shutil.copytree(ROOT / "notebooks", dirs["root"] / "notebooks")
        for workspace in binder_env.workspaces.iterdir():  # what binder/postBuild imported
            shutil.copy(workspace, dirs["workspaces"])

    (tmp_path / "lab").mkdir()
    start = ("bash", str(ROOT / "binder" / "start"))  # what Binder runs before the session's server
    plain = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # as repo2docker starts it
    with running_lab(tmp_path / "lab", python=binder_env.python, prepare=prepare, wrapper=start, base_env=plain) as lab:
        maps = Path(f"/proc/{lab.pid}/maps").read_text()
        # the server binds where it is told (the hub reaches it); kernels get the shim from their kernelspec
        assert "workbench-bind-shim" not in maps, "binder/start gave the Jupyter server itself the bind shim"
        page.goto(lab.url_for("lab"), wait_until="domcontentloaded")
        page.locator(".wb-panel").wait_for(state="visible", timeout=60_000)
        current = page.locator(".jp-MainAreaWidget .lm-TabBar-tab.lm-mod-current, #jp-main-dock-panel .lm-TabBar-tab.lm-mod-current")
        current.filter(has_text="01-quickstart.ipynb").wait_for(timeout=60_000)
        # the notebook's own cells, not the empty cell JupyterLab shows while the file loads
        page.locator(".jp-Notebook .jp-MarkdownCell", has_text="Quick start").first.wait_for(timeout=60_000)
        assert page.locator(".wb-panel h2").inner_text() == "Workbench clusters"
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "binder-start.png"))
