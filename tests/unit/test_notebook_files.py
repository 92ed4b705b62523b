"""The tutorials are valid notebooks as nbformat writes them today (cell ids included)."""

from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_tutorial_is_valid_with_cell_ids_and_no_outputs(path):
    notebook = nbformat.read(path, as_version=nbformat.NO_CONVERT)
    nbformat.validate(notebook)  # raises on a missing cell id from nbformat 4.5 on
    assert (notebook.nbformat, notebook.nbformat_minor) >= (4, 5)
    assert all("id" in cell for cell in notebook.cells)
    assert notebook.metadata.kernelspec.name == "workbench"
    assert not any(cell.get("outputs") for cell in notebook.cells), "outputs are rendered by the docs build, not stored"
