"""The docs' code runs as written: every Python block of README and the user guide, page by page in a fresh
IPython process (as a notebook runs its cells), and every ``%wb`` line anywhere in the docs and tutorials
parses. A block that cannot run here (it needs a Slurm site, other hosts...) starts with ``# not run:`` and
says why; its ``%wb`` lines are still parsed. Getting started's blocks run in JupyterLab
(tests/browser/test_docs_screenshots.py).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time

import pytest
from conftest import ARTIFACTS, ROOT

from workbench.magic_args import parser

PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "guide").glob("*.md"))]
NOT_RUN = "# not run:"
RUNNER = """
import json, sys, time, traceback
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
seconds = []  # each block's, then the stop's: where a page's time goes (test-artifacts/docs-pages.json)
for number, block in enumerate(json.load(open(sys.argv[1]))):
    began = time.monotonic()
    result = shell.run_cell(block, store_history=False)
    seconds.append(round(time.monotonic() - began, 1))
    if not result.success:
        print(f"block {number} failed after {seconds}:\\n{block}", file=sys.stderr)
        sys.exit(1)
# the reader is done with the page: as closing its notebook would, stop what it left running (a job a block
# started and did not wait for ends with its cluster, instead of training to its last step before the exit)
import workbench as wb
began = time.monotonic()
for cluster in wb.running_clusters():
    cluster.stop()
seconds.append(round(time.monotonic() - began, 1))
print("SECONDS " + json.dumps(seconds))
"""


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def runnable(page: str) -> list[str]:
    return [b for b in python_blocks((ROOT / page).read_text()) if not b.lstrip().startswith(NOT_RUN)]


def _wb_lines(text: str) -> list[str]:
    """``%wb`` lines of code blocks and cells, and ``%wb ...`` written inline in prose (between backticks)."""
    joined = re.sub(r"\\\n\s*", " ", text)  # a line continued with a backslash is one line
    lines = [line.strip() for line in joined.splitlines() if re.match(r"\s*%%?wb\b", line)]
    inline = [span for span in re.findall(r"`(%%?wb [^`]+)`", text) if "..." not in span and "|" not in span
              and not re.search(r"\b[A-Z]+\b", span) and span not in ("%%wb on", "%%wb spmd")]  # names, placeholders
    return lines + inline


def test_every_wb_line_in_the_docs_and_tutorials_parses():
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
               if "_build" not in p.parts}
    for notebook in (ROOT / "notebooks").glob("*.ipynb"):
        cells = json.loads(notebook.read_text())["cells"]
        sources[str(notebook.relative_to(ROOT))] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    lines = [(where, line) for where, text in sources.items() for line in _wb_lines(text)]
    assert len(lines) > 30, len(lines)  # the walker finds them
    wrong = []
    for where, line in lines:
        try:  # as IPython hands a line to the magic: a comment after it is part of its arguments
            words = shlex.split(line)[1:]
        except ValueError as exc:
            wrong.append(f"{where}: {line}: {exc}")
            continue
        if words and words[0] == "load_ext":
            continue
        try:
            parser().parse_args(words)
        except Exception as exc:  # noqa: BLE001 - collected, all reported at once
            wrong.append(f"{where}: {line}: {exc}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)])
def test_the_code_of_a_page_runs_as_written(page, tmp_path, no_leftover_processes):
    blocks = ["%load_ext workbench", *runnable(page)]
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    env = {**os.environ, "WORKBENCH_NATIVE_LOGS": "stderr"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", RUNNER, str(tmp_path / "blocks.json")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{page}: {done.stderr[-6000:]}\n{done.stdout[-3000:]}"
    assert "Traceback" not in done.stdout, done.stdout[-6000:]
    timed = [line for line in done.stdout.splitlines() if line.startswith("SECONDS ")]
    assert timed, done.stdout[-3000:]
    _keep_seconds(page, time.monotonic() - started, json.loads(timed[-1].split(" ", 1)[1]))


def _keep_seconds(page: str, total: float, seconds: list[float]) -> None:
    """The page's time (the process's start and import included), its blocks' and its stop's, in
    test-artifacts/docs-pages.json: which of the suite's slowest tests spends its time where."""
    ARTIFACTS.mkdir(exist_ok=True)
    record = ARTIFACTS / "docs-pages.json"
    kept = json.loads(record.read_text()) if record.exists() else {}
    kept[page] = {"total": round(total, 1), "blocks": seconds[:-1], "stop": seconds[-1]}
    record.write_text(json.dumps(kept, indent=1))


def test_a_measured_figure_outside_the_benchmarks_page_says_where_it_comes_from():
    # the benchmarks page holds each goal's figure once; a page that quotes a measurement links to it
    pages = [ROOT / "README.md", ROOT / "docs" / "getting-started.md", ROOT / "docs" / "architecture.md",
             *sorted((ROOT / "docs" / "guide").glob("*.md"))]
    unsourced = []
    for page in pages:
        prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for paragraph in re.split(r"\n\s*\n", prose):
            if re.search(r"\bmeasured\b", paragraph, re.I) and "benchmarks" not in paragraph:
                unsourced.append(f"{page.relative_to(ROOT)}: {paragraph[:120]}")
    assert not unsourced, "link the figure's source (docs/benchmarks.md):\n" + "\n".join(unsourced)
    table = (ROOT / "docs" / "benchmarks.md").read_text().split("## Where each goal stands", 1)[1]
    goals = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| goal")]
    commands = [line.split("|")[4].strip() for line in goals]
    assert len(goals) >= 15 and all("`" in c or c == "the same" for c in commands), commands  # each with its command


FIGURE = re.compile(r"(?<![\w.,-])(\d[\d,]*(?:\.\d+)?)\s?(?:×|%|s\b|ms\b|MiB\b|GiB\b|steps/s|examples/s)")
LINK = re.compile(r"\]\((?:\.\./|docs/)?(benchmarks(?:-history)?)\.md(?:#([\w-]+))?\)")


def _units(text: str) -> list[str]:
    """A page's paragraphs, list items and table rows (code blocks left out)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [unit for paragraph in re.split(r"\n\s*\n", text) for unit in re.split(r"\n(?=\s*(?:[-*] |\d+\. |\|))", paragraph)]


def _section(text: str, anchor: str | None) -> str:
    """The part of a benchmarks page a link points to: the section its anchor names, or the whole page."""
    if not anchor:
        return text
    headers = list(re.finditer(r"^(#+) (.*)$", text, re.M))
    for number, header in enumerate(headers):
        if re.sub(r"[^\w -]", "", header.group(2).strip().lower()).replace(" ", "-") == anchor:
            level = len(header.group(1))  # the section runs to the next header of its level or above
            end = next((h.start() for h in headers[number + 1:] if len(h.group(1)) <= level), len(text))
            return text[header.start():end]
    raise AssertionError(f"no section for #{anchor}")


def test_a_figure_quoted_beside_a_link_to_the_benchmarks_is_the_one_there():
    # a page that quotes a measured figure links to where it comes from, and quotes it as it is there
    targets = {name: (ROOT / "docs" / f"{name}.md").read_text() for name in ("benchmarks", "benchmarks-history")}
    pages = {str(p.relative_to(ROOT)): p.read_text() for p in [ROOT / "README.md", ROOT / "CHANGELOG.md",
             *(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "guide").glob("*.md")] if not p.stem.startswith("benchmarks")}
    for notebook in (ROOT / "notebooks").glob("*.ipynb"):
        cells = json.loads(notebook.read_text())["cells"]
        pages[str(notebook.relative_to(ROOT))] = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    checked, differing = 0, []
    for where, text in pages.items():
        for unit in _units(text):
            links = LINK.findall(unit)
            if not links:
                continue
            sources = " ".join(_section(targets[name], anchor) for name, anchor in links)
            for figure in FIGURE.findall(unit):
                checked += 1
                if not re.search(rf"(?<![\d.]){re.escape(figure)}(?![\d])", sources):
                    differing.append(f"{where}: {figure} is not in {[f'{n}#{a}' for n, a in links]}: {unit[:160]}")
    assert checked >= 5, checked  # the walker finds the quoted figures
    assert not differing, "\n".join(differing)
