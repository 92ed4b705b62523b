"""The docs' code runs as written: every Python block of README and the user guide, page by page in an IPython
shell (as a notebook runs its cells), and every ``%wb`` line anywhere in the docs and tutorials parses. A block
that cannot run here (it needs a Slurm site, other hosts...) starts with ``# not run:`` and says why; its ``%wb``
lines are still parsed. Getting started's blocks run in JupyterLab (tests/browser/test_docs_screenshots.py).

The pages run one after another in one process, as a reader who goes through them in one kernel: each page in
a namespace of its own (reset before it: a name another page defined is a NameError), its clusters stopped
after it and checked gone. One process spares five imports of TensorFlow, in it and in the warm process its
clusters fork from. A page that kills the process fails alone: the next one gets a new process.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import ARTIFACTS, ROOT, commands, wait_gone, warm_children

from workbench.magic_args import parser

PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "guide").glob("*.md"))]
NOT_RUN = "# not run:"
RUNNER = """
import json, os, sys, time
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
for request in sys.stdin:  # one page a line: its directory and its blocks
    page = json.loads(request)
    os.chdir(page["cwd"])  # the files a page writes (checkpoints, a tracking store) are its own
    shell.reset(new_session=False)  # the page's names only, as in a notebook of its own
    seconds, failed = [], None  # each block's, then the stop's: where a page's time goes (docs-pages.json)
    for number, block in enumerate(page["blocks"]):
        began = time.monotonic()
        result = shell.run_cell(block, store_history=False)
        seconds.append(round(time.monotonic() - began, 1))
        if not result.success:
            failed = number
            break
    # the reader is done with the page: as closing its notebook would, stop what it left running (a job a block
    # started and did not wait for ends with its cluster, instead of training to its last step)
    import workbench as wb
    began = time.monotonic()
    for cluster in wb.running_clusters():
        cluster.stop()
    if "wandb" in sys.modules:  # and W&B's service process, which lives as long as its kernel
        sys.modules["wandb"].teardown()
    seconds.append(round(time.monotonic() - began, 1))
    print("PAGE-DONE " + json.dumps({"failed": failed, "seconds": seconds}), flush=True)
"""


class PageRunner:
    """The RUNNER process: ``run(blocks)`` runs a page in it, returns (its stdout, its stderr, its result)."""

    def __init__(self):
        env = {**os.environ, "WORKBENCH_NATIVE_LOGS": "stderr"}
        self.proc = subprocess.Popen([sys.executable, "-c", RUNNER], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()

    def run(self, blocks: list[str], cwd: Path, timeout: float) -> tuple[str, str, dict | None]:
        """The page's output, and its result (None: the process ended, or the page outlasted ``timeout`` and the
        process was killed: its clusters' engines go with their client)."""
        errors_before = len(self.stderr)
        self.proc.stdin.write(json.dumps({"cwd": str(cwd), "blocks": blocks}) + "\n")
        self.proc.stdin.flush()
        lines, result = [], None
        reader = threading.Thread(target=self._read_page, args=(lines,), daemon=True)
        reader.start()
        reader.join(timeout)
        if lines and lines[-1].startswith("PAGE-DONE "):
            result = json.loads(lines.pop().split(" ", 1)[1])
        elif self.alive():
            self.proc.kill()
            self.proc.wait(10)
        return "".join(lines), "".join(self.stderr[errors_before:]), result

    def _read_page(self, lines: list[str]) -> None:
        for line in self.proc.stdout:
            lines.append(line)
            if line.startswith("PAGE-DONE "):
                return

    def alive(self) -> bool:
        return self.proc.poll() is None

    def processes(self) -> set[int]:
        try:
            return {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.Error:
            return set()

    def close(self) -> set[int]:
        """End the process; return what it started that still runs 30 s later."""
        started = self.processes()
        self.proc.stdin.close()  # the loop ends; the warm process it kept exits with its client
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        return wait_gone(started, timeout=30)


@pytest.fixture(scope="module")
def page_runner():
    """The process the pages run in, one after another; a page that ended it gets the next page a new one. At the
    end, nothing it started runs on (its kept warm process exits with it)."""
    runners = [PageRunner()]

    def current() -> PageRunner:
        if not runners[-1].alive():
            runners.append(PageRunner())
        return runners[-1]

    yield current
    leftover = set().union(*(runner.close() for runner in runners))
    assert not leftover, f"the pages' process left {commands(leftover)}"


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
def test_the_code_of_a_page_runs_as_written(page, page_runner, tmp_path):
    runner = page_runner()
    before = runner.processes()
    started = time.monotonic()
    blocks = ["%load_ext workbench", *runnable(page)]
    out, err, result = runner.run(blocks, tmp_path, timeout=600)
    assert result is not None, f"{page}: the page did not end (the process ended: {not runner.alive()}):\n{err[-6000:]}\n{out[-3000:]}"
    assert result["failed"] is None, (f"{page}: block {result['failed']} failed:\n{blocks[result['failed'] or 0]}\n"
                                      f"{err[-6000:]}\n{out[-3000:]}")
    assert "Traceback" not in out, out[-6000:]
    # what the page started stopped with its clusters: only the warm process they forked from may stay for the next
    leftover = wait_gone(runner.processes() - before - warm_children(runner.proc.pid), timeout=20)
    assert not leftover, f"{page} left processes running: {commands(leftover)}"
    _keep_seconds(page, time.monotonic() - started, result["seconds"])


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
