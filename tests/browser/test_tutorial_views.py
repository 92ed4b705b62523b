"""What a newcomer sees: tutorials 01 and 03 under Run All in JupyterLab, with the Workbench panel open at 300 px.

Screenshots go to test-artifacts/ (tutorial-01-*.png, tutorial-03-*.png). What can be asserted is: every
dashboard a tutorial shows spans the job its cell trains (its timeline holds that job's steps and no other
job's; its throughput has no zero outside the job: gaps, not invented zeros); in the panel, no figure, job
name or task line wraps at 300 px, the card with a running job comes first (before an idle cluster whose name sorts
first), and a finished job keeps a figure above 0.
"""

import json
import shutil

import pytest
from conftest import ARTIFACTS, ROOT

from .conftest import JS_WRAPPED, execute_command, run_notebook_in_lab

pytestmark = [pytest.mark.cluster, pytest.mark.browser]

IDLE = "aaa-idle"  # sorts before the tutorials' clusters by name

# every workbench dashboard in the page: its job (progress), the jobs of its timeline's bars and their
# extent, and its throughput bins (time, total examples/s; NaN kept as null)
JS_DASHBOARDS = """() => [...(window.Bokeh ? Bokeh.documents : [])].map((d) => [...d._all_models.values()])
  .filter((models) => models.some((m) => m.name === "dashboard_notice")).map((models) => {
    const bars = models.filter((m) => m.name && m.name.startsWith("timeline_steps_") && m.data && m.data.job);
    const progress = models.find((m) => m.name === "progress");
    const throughput = models.find((m) => m.name === "throughput");
    const named = progress ? /<b>([^<]+)<\\/b>/.exec(progress.text) : null;
    return {
      job: named ? named[1] : null,
      jobs: [...new Set(bars.flatMap((s) => [...s.data.job]))],
      steps: bars.reduce((n, s) => n + s.data.job.length, 0),
      times: throughput ? [...throughput.data.time] : [],
      totals: throughput ? [...throughput.data["total:examples"]].map((v) => (Number.isFinite(v) ? v : null)) : [],
    };
  })"""
JS_FIRST_CARD = """() => { const c = document.querySelector(".wb-clusters .wb-card");
  return c ? {name: c.dataset.cluster, job: (c.querySelector(".wb-job") || {}).textContent || ""} : null; }"""


def _open_panel_at_300px(page) -> None:
    execute_command(page, "workbench:show-panel")  # opens it, never toggles
    page.locator(".wb-panel").wait_for(state="visible", timeout=30_000)
    page.evaluate("""() => { const split = window.jupyterapp.shell._hsplitPanel;
        const left = 300 / split.node.clientWidth; split.setRelativeSizes([left, 1 - left, 0]); }""")
    page.wait_for_timeout(500)


def _start_idle_cluster_from_the_panel(page) -> None:
    page.locator(".wb-start > summary").click()
    form = page.locator(".wb-start-form")
    form.locator("select[name='engines'] option[value='local']").wait_for(state="attached", timeout=10_000)
    form.locator("input[name='ps']").fill("0")
    form.locator("input[name='workers']").fill("1")
    form.locator("input[name='name']").fill(IDLE)
    form.locator(".wb-start-button").click()
    page.locator(f".wb-card[data-cluster='{IDLE}'] .wb-state-running").wait_for(timeout=180_000)
    assert not page.locator(".wb-start").evaluate("(d) => d.open"), "the form stayed open after its start"


def _dashboards(page) -> list[dict]:
    page.wait_for_function(JS_DASHBOARDS.replace("() =>", "() => 0 <") + ".length", timeout=60_000)
    return page.evaluate(JS_DASHBOARDS)


def _assert_spans_its_job(board: dict) -> None:
    """A job's dashboard: one job's bars (the one it names), and throughput that is not zero outside the job."""
    if board["job"] is not None:
        assert board["jobs"] == [board["job"]] and board["steps"] > 0, board["jobs"]
    values = board["totals"]
    positive = [i for i, v in enumerate(values) if v]
    assert positive, f"no throughput drawn: {values}"
    outside = [v for i, v in enumerate(values) if (i < positive[0] or i > positive[-1]) and v is not None]
    assert not outside, f"zeros outside the job's steps (they are gaps): {values}"
    assert len(values) <= positive[-1] - positive[0] + 3, f"the plot spans more than its job: {values}"


def _keep(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name))


def test_tutorials_01_and_03_show_each_sections_job_and_a_panel_that_keeps_up(jupyter_lab, page):
    for name in ("01-quickstart.ipynb", "03-data-parallelism.ipynb"):
        shutil.copy(ROOT / "notebooks" / name, jupyter_lab.root_dir / name)
    page.goto(jupyter_lab.url_for("lab"), wait_until="domcontentloaded")
    page.locator(".wb-panel").wait_for(state="attached", timeout=60_000)
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.commands.hasCommand('workbench:show-panel')",
                           timeout=60_000)
    _open_panel_at_300px(page)
    _start_idle_cluster_from_the_panel(page)

    # tutorial 01: its job's dashboard, and the panel showing the finished job with its figures
    notebook = run_notebook_in_lab(page, jupyter_lab, "01-quickstart.ipynb", timeout=300)
    _open_panel_at_300px(page)
    (board,) = _dashboards(page)
    _assert_spans_its_job(board)
    finished = page.locator(".wb-card", has=page.locator(".wb-job", has_text="finished")).first
    finished.wait_for(timeout=30_000)
    assert float(finished.locator(".wb-rate").get_attribute("data-value")) > 0, finished.inner_text()
    assert "average" in finished.locator(".wb-rate").inner_text()
    assert not page.evaluate(JS_WRAPPED), page.evaluate(JS_WRAPPED)
    notebook.locator(".jp-Cell").nth(9).scroll_into_view_if_needed()
    _keep(page, "tutorial-01-dashboard.png")
    wide = notebook.locator(".jp-Cell .jp-InputArea-editor").evaluate_all(
        "(editors) => editors.filter((e) => e.scrollWidth > e.clientWidth + 2).map((e) => e.textContent.slice(0, 80))")
    assert not wide, f"code wider than the notebook: {wide}"
    # the notebook closed and its kernel shut down (its cluster with it), as a user moving on would
    page.evaluate("""() => { for (const w of [...window.jupyterapp.shell.widgets("main")])
        if (w.context && w.context.path === "01-quickstart.ipynb") { w.context.model.dirty = false; w.dispose(); } }""")
    for session in json.loads(jupyter_lab.api("api/sessions")):
        jupyter_lab.api(f"api/sessions/{session['id']}", method="DELETE", timeout=60)

    # tutorial 03: while a job runs its card comes first; then each section's dashboard is its own job's
    # (the first card is noted every 250 ms from the page's start: opening the notebook loads the page anew)
    page.add_init_script("window.__firstCards = []; window.__watch = setInterval(() => {"
                         f" const c = ({JS_FIRST_CARD})(); if (c) window.__firstCards.push(c); }}, 250);")
    notebook = run_notebook_in_lab(page, jupyter_lab, "03-data-parallelism.ipynb", timeout=400)
    seen = page.evaluate("() => { clearInterval(window.__watch); return window.__firstCards; }")
    running_first = [c for c in seen if c["name"].startswith("tutorial-03") and " running" in c["job"]]
    assert running_first, f"the card of the cluster training never came first: {seen[-5:]}"
    assert all(c["name"] != IDLE or " running" not in c["job"] for c in seen)
    boards = _dashboards(page)
    assert len(boards) == 2, boards  # the straggler job's, the elastic job's throughput
    for board in boards:
        _assert_spans_its_job(board)
    assert boards[0]["job"] and boards[0]["job"].startswith("sync-ps"), boards[0]["job"]
    _open_panel_at_300px(page)
    for index, name in ((6, "tutorial-03-straggler.png"), (11, "tutorial-03-elastic.png")):
        notebook.locator(".jp-Cell").nth(index).scroll_into_view_if_needed()
        _keep(page, name)
    assert not page.evaluate(JS_WRAPPED), page.evaluate(JS_WRAPPED)
