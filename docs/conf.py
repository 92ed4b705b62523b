"""Sphinx configuration of the workbench's documentation (MyST Markdown pages, MyST-NB tutorials).

`make docs` builds it with warnings as errors. Two things are generated at build time, so they never
drift from the code: the API reference (every name in ``workbench.__all__``) and the tutorial pages
(copies of ``notebooks/``, executed during the build with the workbench kernel, unless the test suite
executed the same code: see ``_reuse_tested_tutorials``).
"""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path

import workbench

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent

project = "jupyter-tf-workbench"
author = "The workbench developers"
copyright = "2026, The workbench developers"
release = workbench.__version__
version = ".".join(release.split(".")[:2])

extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.autosummary", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
exclude_patterns = ["_build", "**.ipynb_checkpoints", "README.md"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
html_theme = "pydata_sphinx_theme"
html_title = "jupyter-tf-workbench"
html_static_path = ["_static"]
html_theme_options = {"navigation_with_keys": False, "show_toc_level": 2}

# The tutorials run during the build, each in the workbench kernel, in a temporary directory; a cell error
# fails the build. "cache" re-executes a notebook only when its code changed (jupyter-cache in _build), and
# takes the suite's executed copies when their code is the page's (_reuse_tested_tutorials).
nb_execution_mode = "cache"
nb_execution_cache_path = str(DOCS / "_build" / ".jupyter_cache")
nb_execution_in_temp = True
nb_execution_timeout = 900
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_kernel_rgx_aliases = {".*": "workbench"}

autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
autosummary_generate = True
napoleon_google_docstring = False
napoleon_numpy_docstring = True


def _copy_tutorials() -> None:
    """notebooks/*.ipynb as docs/tutorials/*.ipynb (the pages of the tutorials section)."""
    target = DOCS / "tutorials"
    target.mkdir(exist_ok=True)
    for notebook in sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb")):
        copy = target / notebook.name
        if not copy.exists() or copy.read_bytes() != notebook.read_bytes():
            shutil.copyfile(notebook, copy)


def _reuse_tested_tutorials() -> list[str]:
    """Put into the execution cache the tutorials the test suite executed (``test-artifacts/``, written by
    ``tests/integration/test_tutorials.py``) whose code cells are the page's, every one run, none failed.

    ``make test`` runs the suite, then this build: without this, every tutorial ran twice in it (about
    4 minutes of CI). A copy that does not match, or that stopped at an error, is left out, and the page's
    notebook runs here as before. Returns the names taken.
    """
    import nbformat
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    cache, taken = get_cache(nb_execution_cache_path), []
    for page in sorted((DOCS / "tutorials").glob("[0-9][0-9]-*.ipynb")):
        executed = ROOT / "test-artifacts" / page.name
        if not executed.exists():
            continue
        notebook, ran = nbformat.read(page, as_version=4), nbformat.read(executed, as_version=4)
        code, done = _code_cells(notebook), _code_cells(ran)
        if [c.source for c in code] != [c.source for c in done] or not all(map(_ran_cleanly, done)):
            continue
        try:
            cache.match_cache_notebook(notebook)
            continue  # cached already (by an earlier build, or an earlier copy)
        except KeyError:
            pass
        for cell, result in zip(code, done):
            cell.outputs, cell.execution_count = result.outputs, result.execution_count
        cache.cache_notebook_bundle(CacheBundleIn(notebook, str(page), data={"executed_by": "the test suite"}),
                                    check_validity=False, overwrite=True)
        taken.append(page.stem)
    return taken


def _code_cells(notebook) -> list:
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def _ran_cleanly(cell) -> bool:
    """The cell was executed and showed no error."""
    return cell.execution_count is not None and not any(o.output_type == "error" for o in cell.outputs)


def _kind(name: str) -> str:
    value = getattr(workbench, name)
    if inspect.ismodule(value):
        return "Modules"
    if inspect.isclass(value) and issubclass(value, Warning):
        return "Warnings"
    if inspect.isclass(value) and issubclass(value, BaseException):
        return "Errors"
    if inspect.isclass(value):
        return "Classes"
    if callable(value):
        return "Functions"
    return "Constants"


def _write_api_reference() -> None:
    """docs/api/index.rst: every public name of ``workbench``, by kind, one generated page each."""
    groups: dict[str, list[str]] = {}
    for name in workbench.__all__:
        groups.setdefault(_kind(name), []).append(name)
    lines = ["API reference", "=============", "",
             "Every public name of ``workbench`` (``import workbench as wb``), generated from the docstrings.", "",
             ".. currentmodule:: workbench", ""]
    for kind in ("Classes", "Functions", "Modules", "Errors", "Warnings", "Constants"):
        names = groups.get(kind, [])
        if not names:
            continue
        lines += [kind, "-" * len(kind), "", ".. autosummary::", "   :toctree: generated", ""]
        lines += [f"   {name}" for name in names] + [""]
    target = DOCS / "api" / "index.rst"
    target.parent.mkdir(exist_ok=True)
    text = "\n".join(lines)
    if not target.exists() or target.read_text() != text:
        target.write_text(text)


_copy_tutorials()
if _taken := _reuse_tested_tutorials():
    print(f"tutorials executed by the test suite (test-artifacts/), not run again: {', '.join(_taken)}")
_write_api_reference()

# Bokeh's notebook outputs carry its own mime types (application/vnd.bokehjs_load.v0+json, ..._exec...) beside
# application/javascript in the same bundle; the page renders the JavaScript (BokehJS inlined: the plots draw
# offline). MyST-NB warns about every type of a bundle it does not know, even when another one is rendered.
suppress_warnings = ["mystnb.unknown_mime_type"]


def _check_build(app, exception) -> None:
    """Fail the build when a tutorial page lost its outputs or the API reference misses a public name."""
    if exception is not None or app.builder.name != "html":
        return
    out = Path(app.outdir)
    empty = [p.stem for p in sorted((out / "tutorials").glob("*.html")) if 'class="cell_output' not in p.read_text()]
    generated = {p.name[len("workbench."):-len(".html")] for p in (out / "api" / "generated").glob("workbench.*.html")}
    missing = sorted(set(workbench.__all__) - generated)
    problems = [f"tutorial pages without outputs: {empty}"] * bool(empty) + [f"API pages missing for {missing}"] * bool(missing)
    if problems:
        raise RuntimeError("; ".join(problems))


def setup(app) -> None:
    app.connect("build-finished", _check_build)
