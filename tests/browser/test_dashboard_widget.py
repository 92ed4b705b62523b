"""The notebook dashboard in JupyterLab, in a real browser: it renders, and updates while a job trains."""

import json
import re
import time

import pytest
from conftest import ARTIFACTS

from .conftest import cell_output_text, run_notebook_in_lab, write_notebook

pytestmark = [pytest.mark.cluster, pytest.mark.browser]

CELLS = [
    "import keras\nimport workbench as wb\n"
    "cluster = wb.Cluster(ps=1, workers=1, name='wb-browser-test', progress=False).start()\n"
    "wb.dashboard(cluster)",
    "def make_model():\n"
    "    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation='relu'), keras.layers.Dense(10)])\n"
    "job = wb.train(cluster, make_model, wb.datasets.digits, keras.losses.SparseCategoricalCrossentropy(from_logits=True),\n"
    "               strategy=wb.AsyncPS(steps_per_call=5), steps=4000)\n"
    "print('training started')",
]


TIMELINE_BARS = """() => [...Bokeh.documents].flatMap((d) => [...d._all_models.values()])
    .filter((m) => m.name && m.name.startsWith("timeline_steps_"))
    .reduce((n, s) => n + s.data.right.length, 0)"""


def _steps_shown(page) -> int:
    # a page drawing a live dashboard on a loaded machine can take seconds to answer (it did not in 5 s once)
    text = page.locator(".workbench-steps").first.inner_text(timeout=60_000)
    return int(re.match(r"\s*(\d+)\s*/", text).group(1))


def test_the_dashboard_widget_renders_and_updates_while_a_job_trains(jupyter_lab, page):
    panel = run_notebook_in_lab(page, jupyter_lab, write_notebook(jupyter_lab, "dashboard.ipynb", CELLS))
    assert "training started" in cell_output_text(panel, 1)
    page.locator(".workbench-steps").first.wait_for(timeout=120_000)  # the progress panel of the job
    deadline = time.monotonic() + 120
    first = _steps_shown(page)
    while _steps_shown(page) <= first and time.monotonic() < deadline:
        time.sleep(0.5)
    second = _steps_shown(page)
    assert second > first, f"the widget did not update: {first} then {second} steps"
    # the timeline and throughput plots are drawn (canvases), with the job's bars in the browser's data
    assert page.locator(".jp-OutputArea canvas").count() >= 3
    # the progress text is patched before the timeline's bars in each update, so the bars may land a moment later
    page.wait_for_function(f"() => ({TIMELINE_BARS})() > 0", timeout=60_000, polling=250)
    assert page.evaluate(TIMELINE_BARS) > 0
    assert page.locator(".workbench-throughput-now").first.inner_text() != ""
    # the server extension lists the cluster the notebook's kernel started (through the registry)
    listing = json.loads(jupyter_lab.api("workbench/api/clusters"))
    mine = next(c for c in listing["clusters"] if c["name"] == "wb-browser-test")
    assert [t["name"] for t in mine["tasks"]] == ["ps:0", "worker:0"] and mine["state"] == "running"
    time.sleep(1.0)
    ARTIFACTS.mkdir(exist_ok=True)
    # a loaded machine's browser is busy drawing the live plots: the picture waits as the docs' screenshots do
    page.screenshot(path=str(ARTIFACTS / "dashboard-widget.png"), full_page=True, timeout=180_000)

    # a page reloaded while the job trains shows the timeline's history, not only what streamed since
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")  # the widget's output survives
    before = page.evaluate(TIMELINE_BARS)
    page.reload(wait_until="domcontentloaded")
    page.locator(".workbench-steps").first.wait_for(timeout=120_000)
    page.wait_for_function(f"() => ({TIMELINE_BARS})() > 0", timeout=60_000, polling=250)
    after = page.evaluate(TIMELINE_BARS)
    assert after >= before, f"after a reload the timeline held {after} bars, {before} before it"
