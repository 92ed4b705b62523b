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


def _names(code: str) -> tuple[set[str], set[str]]:
    """The names ``code`` (a notebook's cells, magics as IPython rewrites them) defines, and those it reads."""
    import ast

    from IPython.core.inputtransformer2 import TransformerManager

    tree = ast.parse(TransformerManager().transform_cell(code))
    defined, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else defined).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ExceptHandler) and node.name:
            defined.add(node.name)
    return defined, read


def _sections(notebook) -> list[tuple[str, list[str], str]]:
    """``(heading, code cells, prose)`` of each ``##`` section (its ``###`` parts included), the title's first."""
    sections = [("(title)", [], "")]
    for cell in notebook.cells:
        if cell.cell_type == "markdown" and cell.source.startswith(("# ", "## ")):
            sections.append((cell.source.splitlines()[0], [], cell.source))
        elif cell.cell_type == "code":
            sections[-1][1].append(cell.source)
    return sections


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_tutorial_sets_up_in_its_first_code_cell_and_hides_no_state_between_sections(path):
    import builtins

    notebook = nbformat.read(path, as_version=4)
    sections = [s for s in _sections(notebook) if s[0] != "(title)" or s[1]]
    first = next(cells[0] for _heading, cells, _prose in sections if cells)
    opening = next(c.source for c in notebook.cells if c.cell_type == "code")
    assert first == opening
    setup, _ = _names(first)
    assert "wb" in setup, "the first code cell imports the workbench (import workbench as wb)"
    known = setup | set(dir(builtins)) | {"display", "get_ipython", "_wb_job"}  # IPython's, and %wb train's job
    for heading, cells, prose in sections:
        code = "\n".join(c for c in cells if c != first)
        defined, read = _names(code) if code else (set(), set())
        hidden = sorted(read - defined - known)
        assert not hidden, f"{path.name}, {heading}: uses {hidden} from another section: set it up in the first cell"
        assert cells or len(prose.splitlines()) > 2, f"{path.name}: {heading!r} has neither code nor text under it"


LINE_LIMIT = 110  # characters: what a notebook shows without scrolling at 1400 px with the panel open at 300 px


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_tutorials_code_fits_the_notebook(path):
    notebook = nbformat.read(path, as_version=4)
    wide = [line for cell in notebook.cells if cell.cell_type == "code" for line in cell.source.splitlines()
            if len(line) > LINE_LIMIT]
    assert not wide, f"{path.name}: lines over {LINE_LIMIT} characters (continue them on the next line): {wide}"
