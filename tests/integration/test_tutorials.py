"""Every tutorial, executed top to bottom in a kernel of the Binder environment, and its numbers checked.

The environment is built only from ``binder/`` (see the ``binder_env`` fixture), so a tutorial that
passes here runs on Binder too.
"""

import re

import nbformat
import pytest
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

from conftest import ARTIFACTS, ROOT

pytestmark = pytest.mark.cluster

TUTORIALS = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb"))
CELL_TIMEOUT = 300


def _execute(binder_env, name: str) -> list:
    """Run ``notebooks/name``; return its code cells, executed. The executed copy goes to test-artifacts/."""
    notebook = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    kernels = KernelSpecManager(kernel_dirs=[str(binder_env.kernels)])
    manager = KernelManager(kernel_name="binder", kernel_spec_manager=kernels)
    client = NotebookClient(notebook, km=manager, timeout=CELL_TIMEOUT, resources={"metadata": {"path": str(ROOT / "notebooks")}})
    try:
        client.execute()
    finally:
        if manager.has_kernel:  # the client does not stop a kernel it was given
            manager.shutdown_kernel(now=False)
        ARTIFACTS.mkdir(exist_ok=True)
        nbformat.write(notebook, ARTIFACTS / name)  # executed, for people to look at (and to debug)
    return [c for c in notebook.cells if c.cell_type == "code"]


def _text(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if output.get("name") != "stderr":
            parts.append(output.get("text", ""))
        for key in ("text/plain", "text/html"):
            parts.append(output.get("data", {}).get(key, ""))
    return "\n".join(parts)


def _mimes(cell) -> set[str]:
    return {key for output in cell.get("outputs", []) for key in output.get("data", {})}


def test_the_tutorials_are_numbered_one_to_six():
    assert [t[:2] for t in TUTORIALS] == ["01", "02", "03", "04", "05", "06"]


@pytest.mark.timeout(300)
def test_01_quickstart(binder_env, no_leftover_processes):
    cells = _execute(binder_env, "01-quickstart.ipynb")
    assert "ps:0" in _text(cells[0]) and "running" in _text(cells[0])  # %wb start shows the table
    status_html = _text(cells[1])
    assert "ps:0" in status_html and "worker:1" in status_html and "running" in status_html
    assert "(5050, '/job:worker/replica:0/task:1/device:CPU:0')" in _text(cells[2])
    assert "(385, '/job:ps/replica:0/task:0/device:CPU:0')" in _text(cells[3])
    shown = _mimes(cells[4])  # BokehJS inline (no CDN), then the live widget
    assert {"application/vnd.bokehjs_load.v0+json", "application/vnd.jupyter.widget-view+json"} <= shown
    assert "'step': 199" in _text(cells[5])
    accuracy = float(_text(cells[6]).split("'accuracy': ")[1].split(",")[0])
    assert accuracy >= 0.9
    assert "ps:0" in _text(cells[7]) and "kernel" in _text(cells[7])
    assert "stopped" in _text(cells[8])


@pytest.mark.timeout(300)
def test_02_graph_and_devices_finds_send_recv_pairs(binder_env, no_leftover_processes):
    cells = _execute(binder_env, "02-graph-and-devices.ipynb")
    placed = _text(cells[1])
    assert "w lives on /job:ps/replica:0/task:0" in placed and "y computed on /job:worker/replica:0/task:0" in placed
    graph = _text(cells[2])
    assert re.search(r"MatMul\s+/job:worker/task:0", graph) and re.search(r"Sum\s+/job:worker/task:1", graph)
    pairs = _text(cells[4])
    sends, linked = map(int, re.search(r"(\d+) Send ops traced; (\d+) linked", pairs).groups())
    assert sends > 0 and linked > 0
    for source, target in [("ps:0", "worker:0"), ("worker:0", "ps:0"), ("ps:0", "worker:1"), ("worker:1", "ps:0")]:
        assert int(re.search(rf"{source}\s+-> {target}\s+(\d+) transfers", pairs).group(1)) > 0
    unlinked = [int(n) for n in re.findall(r"^\s+(\d+) [a-z]", pairs.split("not linked:")[1], re.M)]
    assert linked + sum(unlinked) == sends and linked > sends / 3, pairs  # every Send accounted for, a good share linked
    assert "application/vnd.bokehjs_exec.v0+json" in _mimes(cells[5])  # the trace, drawn
    assert "stopped" in _text(cells[6])


@pytest.mark.timeout(400)
def test_03_data_parallelism_compares_strategies_and_shows_what_backup_workers_buy(binder_env, no_leftover_processes):
    cells = _execute(binder_env, "03-data-parallelism.ipynb")
    rows = {m.group(1): [float(v) for v in m.groups()[1:]]
            for m in re.finditer(r"^(async-ps|sync-ps|allreduce)\s+([\d.]+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", _text(cells[1]), re.M)}
    assert set(rows) == {"async-ps", "sync-ps", "allreduce"}
    assert all(accuracy >= 0.85 for *_, accuracy in rows.values()), rows
    assert "application/vnd.bokehjs_exec.v0+json" in _mimes(cells[2])  # throughput bars and loss curves
    assert "application/vnd.jupyter.widget-view+json" in _mimes(cells[3])  # the live dashboard
    straggler = _text(cells[4])
    waiting = float(re.search(r"no backup worker:\s+(\d+) ms", straggler).group(1))
    backup = float(re.search(r"one backup worker:\s+(\d+) ms", straggler).group(1))
    share = float(re.search(r"worker:2 made it into (\d+)%", straggler).group(1))
    assert backup < waiting / 2 and share < 50, straggler


@pytest.mark.timeout(300)
def test_04_model_parallelism_trains_a_split_model(binder_env, no_leftover_processes):
    cells = _execute(binder_env, "04-model-parallelism.ipynb")
    table = _text(cells[1])
    assert "hidden1" in table and "worker:0" in table and "backward on" in table
    assert "application/vnd.jupyter.widget-view+json" in _mimes(cells[2])
    result = _text(cells[3])
    assert "'hidden1': 'worker:0', 'hidden2': 'worker:1'" in result
    assert float(re.search(r"test accuracy ([\d.]+)", result).group(1)) >= 0.9


@pytest.mark.timeout(400)
def test_05_scaling_study_measures_every_configuration(binder_env, no_leftover_processes):
    cells = _execute(binder_env, "05-scaling-study.ipynb")
    measured = {(int(w), int(b)): float(x) for w, b, x in
                re.findall(r"workers=(\d) batch=\s*(\d+):\s+[\d.]+ steps/s\s+(\d+) examples/s", _text(cells[1]))}
    assert set(measured) == {(w, b) for w in (1, 2, 3) for b in (48, 192, 768)}
    assert measured[(1, 768)] > measured[(1, 48)]  # a larger batch amortizes the per-step cost
    assert "application/vnd.bokehjs_exec.v0+json" in _mimes(cells[2])
    assert "fastest:" in _text(cells[3])


@pytest.mark.timeout(300)
def test_06_laptop_to_cluster(binder_env, no_leftover_processes):
    cells = _execute(binder_env, "06-laptop-to-cluster.ipynb")
    assert "engines='slurm'" in _text(cells[0]) and "new" in _text(cells[0])
    assert "unknown launcher option(s) 'queues'" in _text(cells[1]) and "queue" in _text(cells[1])
    assert "need 2 GPU(s), but this machine has none" in _text(cells[2])
    result = _text(cells[3])
    assert "worker:1" in result and float(re.search(r"test accuracy ([\d.]+)", result).group(1)) >= 0.85
