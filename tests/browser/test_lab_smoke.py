"""The browser-test infrastructure end to end: a notebook with text, an ipywidget and a Bokeh plot runs in
JupyterLab in headless Chromium, and all three render."""

import pytest
from conftest import ARTIFACTS
from playwright.sync_api import expect

from .conftest import cell_output, cell_output_text, run_notebook_in_lab, write_notebook

pytestmark = pytest.mark.browser

CELLS = [
    "squares = sum(i * i for i in range(10))\nprint(f'sum of squares: {squares}')",
    # BokehJS inline: there is no CDN to load it from
    "import bokeh.io, bokeh.resources\nbokeh.io.output_notebook(resources=bokeh.resources.INLINE, hide_banner=True)",
    "import ipywidgets\nfrom bokeh.plotting import figure\nfrom jupyter_bokeh import BokehModel\n"
    "plot = figure(width=400, height=250, title='smoke')\nplot.line([0, 1, 2, 3], [0, 1, 4, 9])\n"
    "ipywidgets.VBox([ipywidgets.IntSlider(value=3, max=10, description='smoke'), BokehModel(plot)])",
]

# Pixels of a canvas that are neither transparent nor white: grid, axes and the line once Bokeh has drawn.
_INKED_PIXELS = """(canvas) => {
  const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
  let inked = 0;
  for (let i = 0; i < data.length; i += 4) {
    if (data[i + 3] && (data[i] < 250 || data[i + 1] < 250 || data[i + 2] < 250)) inked++;
  }
  return inked;
}"""


def test_a_notebook_with_text_a_widget_and_a_bokeh_plot_renders_in_lab(jupyter_lab, page):
    panel = run_notebook_in_lab(page, jupyter_lab, write_notebook(jupyter_lab, "smoke.ipynb", CELLS))

    assert "sum of squares: 285" in cell_output_text(panel, 0)
    widgets = cell_output(panel, 2)
    slider = widgets.locator(".jupyter-widgets.widget-slider")
    expect(slider).to_be_visible(timeout=60_000)
    expect(slider.locator(".widget-readout")).to_have_text("3")
    # Bokeh draws into canvases inside the figure's shadow root (playwright's selectors pierce it)
    canvas = widgets.locator(".bk-Figure canvas").first
    expect(canvas).to_be_visible(timeout=60_000)
    page.wait_for_function(f"(canvas) => ({_INKED_PIXELS})(canvas) > 1000", arg=canvas.element_handle(),
                           polling=250, timeout=30_000)
    expect(widgets).not_to_contain_text("Error")  # what the widget manager shows instead of a broken view
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "lab-smoke.png"))
