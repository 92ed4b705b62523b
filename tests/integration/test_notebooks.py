"""Tutorial notebooks run top to bottom in a real kernel."""


import nbformat
import pytest
from nbclient import NotebookClient

from conftest import ARTIFACTS, ROOT

pytestmark = pytest.mark.cluster


def _execute(name: str, timeout: int = 300) -> nbformat.NotebookNode:
    notebook = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    NotebookClient(notebook, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    ARTIFACTS.mkdir(exist_ok=True)
    nbformat.write(notebook, ARTIFACTS / name)  # the executed copy, for people to look at
    return notebook


def _text(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        parts.append(output.get("text", ""))
        for key in ("text/plain", "text/html"):
            parts.append(output.get("data", {}).get(key, ""))
    return "\n".join(parts)


def test_quickstart(no_leftover_processes):
    notebook = _execute("01-quickstart.ipynb")
    cells = [c for c in notebook.cells if c.cell_type == "code"]
    assert "ps:0" in _text(cells[0]) and "running" in _text(cells[0])  # %wb start shows the table
    status_html = _text(cells[1])
    assert "ps:0" in status_html and "worker:1" in status_html and "running" in status_html
    assert "(5050, '/job:worker/replica:0/task:1/device:CPU:0')" in _text(cells[2])
    assert "(385, '/job:ps/replica:0/task:0/device:CPU:0')" in _text(cells[3])
    shown = [o.get("data", {}) for o in cells[4].outputs]  # BokehJS inline (no CDN), then the live widget
    assert any("application/vnd.bokehjs_load.v0+json" in d for d in shown)
    assert any("application/vnd.jupyter.widget-view+json" in d for d in shown), [list(d) for d in shown]
    assert "'step': 199" in _text(cells[5])
    accuracy = float(_text(cells[6]).split("'accuracy': ")[1].split(",")[0])
    assert accuracy >= 0.9
    assert "ps:0" in _text(cells[7]) and "kernel" in _text(cells[7])
    assert "stopped" in _text(cells[8])
