"""The README's and the docs' screenshots, from a real run: a notebook trains, the panel shows it, its plots
and an op-level profile open as panes; getting started's five minutes, run as written.

The test checks what the pictures show (live bars, a profile with Send/Recv links) and saves them to
test-artifacts/. `make screenshots` runs it with WORKBENCH_DOCS_SCREENSHOTS=1, which also writes them to
docs/_static/ (panel-dashboards.png, merged-timeline.png, getting-started.png), where README.md and the docs
take them from.
"""

import json
import os
import shutil
import time

import pytest
from conftest import ARTIFACTS, ROOT
from training_helpers import PACED_DIGITS

from .conftest import cell_output, cell_output_text, run_notebook_in_lab, write_notebook

pytestmark = [pytest.mark.cluster, pytest.mark.browser]

CLUSTER = "wb-docs"
CELLS = [
    "import keras\nimport workbench as wb\n"
    f"cluster = wb.Cluster(ps=1, workers=2, name={CLUSTER!r}, progress=False).start()\n"
    # paced: a job that trains for the whole test beside the rest of the suite, and a profile a page can draw (at full
    # speed alone, a 2 s capture held 62,775 ops, and the profile's pane had drawn nothing after 180 s)
    + PACED_DIGITS,
    "def make_model():\n"
    "    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation='relu'),\n"
    "                             keras.layers.Dense(256, activation='relu'), keras.layers.Dense(10)])\n"
    "job = wb.train(cluster, make_model, paced_digits, keras.losses.SparseCategoricalCrossentropy(from_logits=True),\n"
    "               strategy=wb.AsyncPS(steps_per_call=5), steps=100_000)\n"
    "job.wait_set_up()\n"
    "print('training')",
    # the documented default window: a loaded machine's one-second window held no whole transfer once
    # profiled once the job trains (a loaded machine's first steps came more than 4 s after its set-up once)
    "import time\ndeadline = time.monotonic() + 120\n"
    "while job.steps_done < 50 and job.state == 'running' and time.monotonic() < deadline:\n    time.sleep(0.2)\n"
    "profile = cluster.profile()\n"
    "print(len(profile.transfers), 'transfers linked;', len(profile.events), 'ops; unlinked:', profile.unlinked())",
]
# bars in the Bokeh documents of a frame, by model name prefix
JS_BARS = """(prefix) => [...(window.Bokeh ? Bokeh.documents : [])].flatMap((d) => [...d._all_models.values()])
    .filter((m) => m.name && m.name.startsWith(prefix) && m.data && m.data.right).reduce((n, s) => n + s.data.right.length, 0)"""
# the profile's x range narrowed to 25 ms from the first op after its middle (a step or two of the paced job), so
# that single ops and links show
JS_ZOOM = """() => { const models = [...Bokeh.documents].flatMap((d) => [...d._all_models.values()]);
    const ops = models.find((m) => m.name === "profile_ops"); const left = [...ops.data.left];
    const middle = (Math.min(...left) + Math.max(...left)) / 2;
    const start = Math.min(...left.filter((l) => l >= middle)) - 1;
    for (const r of models.filter((m) => m.type === "DataRange1d" || m.type === "Range1d"))
        if (r.start > 1e12) { r.start = start; r.end = start + 25; } }"""
JS_LINKS = """() => [...(window.Bokeh ? Bokeh.documents : [])].flatMap((d) => [...d._all_models.values()])
    .filter((m) => m.name === "profile_transfers" && m.data && m.data.x0).reduce((n, s) => n + s.data.x0.length, 0)"""
# what a pane's frame holds, for a wait that ran out
JS_HOLDS = """() => window.Bokeh ? `${Bokeh.documents.length} Bokeh document(s), ${Bokeh.documents.reduce((n, d) =>
    n + d._all_models.size, 0)} models` : `no Bokeh yet (${document.readyState})`"""
# the live dashboard keeps a loaded machine's browser busy drawing (a click waits for it, as a pane's load does)
PANE_WAIT_MS = 180_000


def _pane(page, plot: str):
    element = page.locator(f".wb-plot-pane iframe[data-cluster='{CLUSTER}'][data-plot='{plot}']")
    element.wait_for(state="attached", timeout=PANE_WAIT_MS)
    frame = element.element_handle().content_frame()
    frame.wait_for_load_state("load", timeout=PANE_WAIT_MS)
    return frame


def _wait_for(frame, what: str, js: str, arg=None) -> None:
    """Wait for ``js`` to hold in a pane's frame; if it does not, fail saying what the frame holds."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        frame.wait_for_function(js, arg=arg, timeout=PANE_WAIT_MS, polling=250)
    except PlaywrightTimeout:
        pytest.fail(f"{what}: not within {PANE_WAIT_MS // 1000} s; the pane holds {frame.evaluate(JS_HOLDS)}, "
                    f"{frame.evaluate(JS_BARS, 'timeline_steps_')} step bars, {frame.evaluate(JS_BARS, 'profile_ops')} "
                    f"profile ops, {frame.evaluate(JS_LINKS)} links")


def _keep(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), timeout=PANE_WAIT_MS)
    if os.environ.get("WORKBENCH_DOCS_SCREENSHOTS") == "1":
        shutil.copyfile(ARTIFACTS / name, ROOT / "docs" / "_static" / name)


def test_the_docs_screenshots_show_live_plots_and_a_merged_profile(jupyter_lab, page):
    notebook = write_notebook(jupyter_lab, "docs.ipynb", CELLS)
    panel = run_notebook_in_lab(page, jupyter_lab, notebook, timeout=300)
    assert "training" in cell_output_text(panel, 1)
    linked = cell_output_text(panel, 2)
    assert "transfers linked" in linked and int(linked.split()[0]) > 0, linked

    page.locator(".jp-SideBar [data-id='workbench-panel']").click()
    card = page.locator(f".wb-card[data-cluster='{CLUSTER}']")
    card.wait_for(timeout=30_000)
    page.wait_for_function(f"""() => {{ const r = document.querySelector(".wb-card[data-cluster='{CLUSTER}'] .wb-rate");
        return r && parseFloat(r.textContent) > 0; }}""", timeout=120_000, polling=500)
    card.locator(".wb-plot[data-plot='dashboard']").click(timeout=PANE_WAIT_MS)
    frame = _pane(page, "dashboard")
    _wait_for(frame, "the dashboard pane's timeline drew 20 steps", JS_BARS.replace("(prefix) =>", "(prefix) => 20 <"),
              "timeline_steps_")
    page.wait_for_timeout(1500)  # the throughput plot's next update
    _keep(page, "panel-dashboards.png")

    card.locator(".wb-plot[data-plot='profile']").click(timeout=PANE_WAIT_MS)
    frame = _pane(page, "profile")
    _wait_for(frame, "the profile pane drew a linked transfer", JS_LINKS.replace("() =>", "() => 0 <"))
    assert frame.evaluate(JS_BARS, "profile_ops") > 0, "the profile pane shows no op"
    frame.evaluate(JS_ZOOM)
    page.wait_for_timeout(1000)
    _keep(page, "merged-timeline.png")

    # the kernel goes, and its cluster with it
    kernel_id = json.loads(jupyter_lab.api("api/sessions"))[0]["kernel"]["id"]
    jupyter_lab.api(f"api/kernels/{kernel_id}", method="DELETE", timeout=60)
    card.wait_for(state="detached", timeout=90_000)


def _getting_started_cells() -> list[str]:
    """The Python blocks of getting started's five-minute section, as written there."""
    text = (ROOT / "docs" / "getting-started.md").read_text()
    section = text.split("## Five minutes to a trained model", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in section.split("```python\n")[1:] for block in [block.split("```", 1)[0]]]


def test_getting_started_runs_as_written_and_shows_its_dashboard(jupyter_lab, page):
    cells = _getting_started_cells()
    assert len(cells) == 5 and cells[-1] == "cluster.stop()", cells
    notebook = write_notebook(jupyter_lab, "getting-started.ipynb", cells)
    started = time.monotonic()
    panel = run_notebook_in_lab(page, jupyter_lab, notebook, timeout=300)
    page.wait_for_function(JS_BARS.replace("(prefix) =>", "(prefix) => 20 <"), arg="timeline_steps_", timeout=90_000,
                           polling=250)
    seconds = time.monotonic() - started
    status, evaluated = cell_output_text(panel, 0), cell_output_text(panel, 3)
    print(f"getting started, from opening the notebook to the trained model's dashboard: {seconds:.0f} s; {evaluated}")
    assert status.count("running") >= 3 and "ps:0" in status and "worker:1" in status, status
    accuracy = float(evaluated.split("'accuracy':")[1].split(",")[0])
    assert accuracy >= 0.85, evaluated  # the page says "about 0.95"
    assert "stopped" in cell_output_text(panel, 4) or cell_output_text(panel, 4).strip() == ""
    cell_output(panel, 1).scroll_into_view_if_needed()
    _keep(page, "getting-started.png")
