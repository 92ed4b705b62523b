"""The Workbench panel in a real JupyterLab and Chromium.

It lists a cluster that a notebook kernel started; opens its timeline as a main-area pane that
updates (through the Jupyter server's proxy), and not while another tab covers it; starts, scales
and stops a cluster of its own; inserts the connection code into the notebook; restores the pane
after a reload; and forgets the kernel's cluster once the kernel restarts.
"""

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import ARTIFACTS, read_line
from training_helpers import PACED_DIGITS, attached_trainer

from workbench.cluster.network import netns
from workbench.dashboard.server import HIDDEN, PAGE_ROOT

from .conftest import JS_WRAPPED, cell_output_text, execute_command, run_notebook_in_lab, write_notebook

pytestmark = [pytest.mark.cluster, pytest.mark.browser]

KERNEL_CLUSTER = "wb-panel-kernel"
PANEL_CLUSTER = "wb-panel-started"
CELLS = [
    "import keras\nimport workbench as wb\n"
    f"cluster = wb.Cluster(ps=1, workers=1, name={KERNEL_CLUSTER!r}, progress=False, network='1gbit').start()",
    PACED_DIGITS +  # a job that trains for the whole test, not one that takes the cores from the rest of the suite
    "def make_model():\n"
    "    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation='relu'), keras.layers.Dense(10)])\n"
    "job = wb.train(cluster, make_model, paced_digits, keras.losses.SparseCategoricalCrossentropy(from_logits=True),\n"
    "               strategy=wb.AsyncPS(steps_per_call=5), steps=100_000)\n"
    "print('training started')",
]
# every bar in the timeline's Bokeh documents, in the frame of the pane
JS_TIMELINE_BARS = """() => [...(window.Bokeh ? Bokeh.documents : [])].flatMap((d) => [...d._all_models.values()])
    .filter((m) => m.name && m.name.startsWith("timeline_steps_")).reduce((n, s) => n + s.data.right.length, 0)"""

# the tags of the page's root: JupyterLab's pane tags it hidden behind another tab
JS_PAGE_TAGS = f"""() => [...(window.Bokeh ? Bokeh.documents : [])].map((d) => d.get_model_by_name({PAGE_ROOT!r}))
    .filter((m) => m).flatMap((m) => m.tags).join(",")"""


def _listing(lab) -> dict:
    return {c["name"]: c for c in json.loads(lab.api("workbench/api/clusters"))["clusters"]}


def _card(page, name: str):
    return page.locator(f".wb-card[data-cluster='{name}']")


def _pane_frame(page, plot: str, timeout: float = 60.0):
    """The frame of the main-area pane that shows ``plot`` of the kernel's cluster."""
    frame_element = page.locator(f".wb-plot-pane iframe[data-cluster='{KERNEL_CLUSTER}'][data-plot='{plot}']")
    frame_element.wait_for(state="attached", timeout=timeout * 1000)
    frame = frame_element.element_handle().content_frame()
    frame.wait_for_load_state("load", timeout=timeout * 1000)
    assert frame.url.endswith(f"/workbench/dashboards/{KERNEL_CLUSTER}/{plot}"), frame.url
    return frame


def _next_list_refresh(page) -> None:
    """Wait for the panel's next list refresh to come back and be drawn."""
    with page.expect_response(lambda r: r.url.split("?")[0].endswith("/workbench/api/clusters"), timeout=30_000):
        pass
    page.wait_for_timeout(300)


def _wait_for_card_text(card, selector: str, text: str, timeout: float) -> None:
    """Wait for ``text`` in ``selector`` within ``card``; on a timeout, say what the card showed instead."""
    try:
        card.locator(selector, has_text=text).wait_for(timeout=timeout * 1000)
    except Exception:  # noqa: BLE001 - re-raised with the card's own words
        pytest.fail(f"no {selector!r} with {text!r} after {timeout:.0f} s; the card shows: {card.inner_text()!r}")


def _bars_grow(frame, timeout: float = 90.0) -> tuple[int, int]:
    frame.wait_for_function(JS_TIMELINE_BARS.replace("() =>", "() => 0 <"), timeout=timeout * 1000, polling=250)
    first = frame.evaluate(JS_TIMELINE_BARS)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and frame.evaluate(JS_TIMELINE_BARS) <= first:
        time.sleep(0.5)
    return first, frame.evaluate(JS_TIMELINE_BARS)


# a user's whole session with the panel (start, refuse, scale, stop, panes, two kernels): 270-330 s in full runs, 485 s
# beside the suite and another browser test; past the suite's 600 s once on such a machine
@pytest.mark.timeout(900)
def test_the_panel_manages_clusters_and_opens_live_dashboards(jupyter_lab, page):
    notebook = write_notebook(jupyter_lab, "panel.ipynb", CELLS)
    panel = run_notebook_in_lab(page, jupyter_lab, notebook)
    assert "training started" in cell_output_text(panel, 1)

    # the panel lists the kernel's cluster: tasks, health, live throughput
    page.locator(".jp-SideBar [data-id='workbench-panel']").click()
    card = _card(page, KERNEL_CLUSTER)
    card.wait_for(timeout=30_000)
    first_row = card.locator("tr[data-task]").all_inner_texts()[0]
    assert first_row.split("\t")[0] == "ps:0", first_row
    assert card.locator("tr[data-task-of='ps:0']").inner_text() == "engine 0 · CPU:0"
    assert "running" in card.locator("tr[data-task='worker:0']").inner_text()
    # the task table fits the sidebar at 300 px (it was cut off at the default width)
    page.evaluate("""() => { const split = window.jupyterapp.shell._hsplitPanel;  // left area | main area | right area
        const left = 300 / split.node.clientWidth; split.setRelativeSizes([left, 1 - left, 0]); }""")
    page.wait_for_timeout(500)
    left = page.locator("#jp-left-stack").evaluate("(e) => e.getBoundingClientRect().width")
    assert abs(left - 300) < 10, f"the sidebar is {left} px wide"
    widths = card.locator(".wb-tasks").evaluate("(t) => [t.scrollWidth, t.clientWidth, t.parentElement.clientWidth]")
    assert widths[0] <= widths[1] <= widths[2], f"the task table needs {widths[0]} px in a {widths[2]} px card"
    assert not page.evaluate(JS_WRAPPED), page.evaluate(JS_WRAPPED)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "panel-300px.png"))
    backend = "user-space" if netns.problem() else "netns"  # network='1gbit': auto picks netns as root
    assert f"links: {backend} links" in card.locator(".wb-links").inner_text()
    assert card.locator(".wb-links").inner_text().endswith("all: 1 Gbit/s")
    page.wait_for_function(f"""() => {{ const r = document.querySelector(".wb-card[data-cluster='{KERNEL_CLUSTER}'] .wb-rate");
        return r && parseFloat(r.textContent) > 0; }}""", timeout=120_000, polling=500)

    # a second kernel attached to the cluster trains too: the panel shows both jobs, with their numbers
    attached = subprocess.Popen([sys.executable, "-c", attached_trainer(KERNEL_CLUSTER)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "WORKBENCH_REGISTRY_DIR": str(jupyter_lab.registry)})
    try:
        theirs = read_line(attached, 180, "its job's name").strip()
        assert theirs.endswith(f"(pid {attached.pid})"), theirs
        page.wait_for_function(f"""() => {{ const c = document.querySelector(".wb-card[data-cluster='{KERNEL_CLUSTER}']");
            const t = c ? c.textContent : ""; return t.includes({json.dumps(theirs)}) && t.includes("also running: job async-ps-1"); }}""",
                               timeout=120_000, polling=500)
        page.screenshot(path=str(ARTIFACTS / "panel-two-kernels.png"))
    finally:
        attached.kill()  # it owns nothing: the owner's cluster runs on (its graceful stop: see test_attach.py)
        attached.wait(30)

    # the timeline opens as a main-area pane, served through Jupyter, and updates
    card.locator(".wb-plot[data-plot='timeline']").click()
    first, second = _bars_grow(_pane_frame(page, "timeline"))
    assert second > first, f"the timeline pane did not update: {first} then {second} bars"
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "panel-timeline.png"))

    # connection code goes into the last active notebook, below its active cell (the pane is in front)
    card.locator(".wb-insert").click()
    expect_code = f'cluster = wb.attach("{KERNEL_CLUSTER}")'
    page.wait_for_function(f"""() => [...document.querySelectorAll(".jp-Notebook .jp-Cell .jp-InputArea-editor")]
        .some((e) => e.textContent.includes({json.dumps(expect_code)}))""", timeout=10_000)

    # behind the notebook's tab the pane is not updated (nothing to draw); in front again it catches up
    frame = _pane_frame(page, "timeline")
    page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text="panel.ipynb").click()
    frame.wait_for_function(JS_PAGE_TAGS.replace("() =>", f"() => {HIDDEN!r} ==="), timeout=30_000, polling=250)
    page.wait_for_timeout(1000)  # an update under way when the tag arrived
    hidden = frame.evaluate(JS_TIMELINE_BARS)
    page.wait_for_timeout(3000)
    assert frame.evaluate(JS_TIMELINE_BARS) == hidden, "the hidden pane was still updated"
    page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text="Timeline").click()
    first, second = _bars_grow(frame)
    assert frame.evaluate(JS_PAGE_TAGS) == "" and second > first >= hidden, (hidden, first, second)

    # start, scale and stop a cluster from the panel's form
    page.locator(".wb-start > summary").click()
    form = page.locator(".wb-start-form")
    form.locator("select[name='engines'] option[value='local']").wait_for(state="attached", timeout=10_000)
    form.locator("input[name='workers']").fill("1")
    form.locator("input[name='name']").fill(PANEL_CLUSTER)
    # the launcher's options reach it: a queue means nothing to local engines, and the panel says so
    form.locator(".wb-start-site summary").click()
    form.locator("input[name='queue']").fill("gpu")
    form.locator(".wb-start-button").click()
    page.locator(".wb-status.wb-error").wait_for(timeout=30_000)
    assert "unknown launcher option(s) 'queue'" in page.locator(".wb-status").inner_text()
    form.locator("input[name='queue']").fill("")
    form.locator(".wb-start-button").click()
    started = _card(page, PANEL_CLUSTER)
    started.wait_for(timeout=180_000)  # its card comes while it starts, and says so
    assert "started from this panel" in started.locator(".wb-owner").inner_text()
    started.locator(".wb-state-running").wait_for(timeout=180_000)
    assert _listing(jupyter_lab)[PANEL_CLUSTER]["owned_here"]
    page.wait_for_function("() => !document.querySelector('.wb-start').open", timeout=30_000)  # the form folded
    assert f"Cluster {PANEL_CLUSTER} started" in page.locator(".wb-status").inner_text()
    page.locator(".wb-start > summary").click()
    form.locator(".wb-start-button").click()  # the same name again: the server's reason, in the panel
    page.locator(".wb-status.wb-error").wait_for(timeout=30_000)
    assert f"a cluster named '{PANEL_CLUSTER}' is already running" in page.locator(".wb-status").inner_text()
    workers = started.locator(".wb-workers")
    workers.fill("2")
    _next_list_refresh(page)  # while the user is in the field, a refresh neither takes the focus nor the count
    assert workers.evaluate("(e) => document.activeElement === e"), "a refresh took the focus from the worker field"
    workers.blur()  # and when the user moves to Scale, the next refresh keeps the typed count
    _next_list_refresh(page)
    assert workers.input_value() == "2", "a refresh overwrote the worker count the user typed"
    started.locator(".wb-scale").click()
    _wait_for_card_text(started, ".wb-feedback", "Now 2 worker(s)", timeout=180.0)  # the PATCH's answer
    _wait_for_card_text(started, "tr[data-task='worker:1']", "worker:1", timeout=30.0)  # the next list refresh
    page.screenshot(path=str(ARTIFACTS / "panel-clusters.png"))
    started.locator(".wb-stop").click()
    page.locator(".jp-Dialog .jp-mod-warn").click()
    started.wait_for(state="detached", timeout=120_000)
    assert PANEL_CLUSTER not in _listing(jupyter_lab)
    # a pane of a cluster that is not running says so in a page of its own
    base = page.evaluate("() => JSON.parse(document.getElementById('jupyter-config-data').textContent).baseUrl")
    execute_command(page, "workbench:open-plot", {"cluster": PANEL_CLUSTER, "name": "timeline", "title": "Timeline",
                                                  "path": f"{base}workbench/dashboards/{PANEL_CLUSTER}/timeline"})
    gone = page.locator(f".wb-plot-pane iframe[data-cluster='{PANEL_CLUSTER}']")
    gone.wait_for(state="attached", timeout=30_000)
    frame = gone.element_handle().content_frame()
    frame.wait_for_selector(".wb-unavailable", timeout=30_000)
    assert f"Cluster '{PANEL_CLUSTER}' is not running" in frame.inner_text("body")
    page.screenshot(path=str(ARTIFACTS / "panel-stopped-pane.png"))
    page.evaluate("(id) => window.jupyterapp.shell.widgets('main') && [...window.jupyterapp.shell.widgets('main')]"
                  ".filter((w) => w.id === id).forEach((w) => w.close())", f"workbench-plot-{PANEL_CLUSTER}-timeline")

    # a reload restores the open pane, which keeps updating
    page.reload(wait_until="domcontentloaded")
    first, second = _bars_grow(_pane_frame(page, "timeline"))
    assert second > first, f"the restored pane did not update: {first} then {second} bars"

    # a kernel restart ends the kernel's cluster: the panel shows what still runs
    kernel_id = json.loads(jupyter_lab.api("api/sessions"))[0]["kernel"]["id"]
    jupyter_lab.api(f"api/kernels/{kernel_id}/restart", method="POST", timeout=60)
    execute_command(page, "workbench:show-panel")
    _card(page, KERNEL_CLUSTER).wait_for(state="detached", timeout=90_000)
    assert KERNEL_CLUSTER not in _listing(jupyter_lab)
    assert page.locator(".wb-empty").is_visible()

    # through all of it (a training kernel, proxied dashboards, a panel cluster started, scaled, stopped,
    # a kernel restart) the Jupyter server logged no traceback
    log = jupyter_lab.log_path.read_text(errors="replace")
    (ARTIFACTS / "panel-server-log.txt").write_text(log)
    assert "Traceback" not in log and "Event loop stopped before Future completed" not in log, log[-4000:]
