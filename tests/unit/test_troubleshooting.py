"""Every public error and warning has a troubleshooting section, and its message links to it."""

import re
import warnings
from pathlib import Path

import pytest

import workbench as wb
from workbench.errors import DOCUMENTED, HELP_PAGE, help_url

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "troubleshooting.md"
PUBLIC = sorted(name for name in wb.__all__
                if isinstance(getattr(wb, name), type) and issubclass(getattr(wb, name), (Exception, Warning)))


def _anchors(markdown: str) -> set[str]:
    """The anchors of the page's headings as GitHub and MyST make them (lowercase, punctuation dropped, spaces
    to dashes)."""
    headings = re.findall(r"^#{1,3} (.+)$", markdown, re.M)
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}


def test_every_public_error_and_warning_has_its_own_section():
    assert len(PUBLIC) >= 19, PUBLIC  # the walker finds them
    text = PAGE.read_text()
    missing = [name for name in PUBLIC if f"### `{name}`" not in text or name not in DOCUMENTED]
    assert not missing, f"add a section (### `Name`) to {PAGE.name} and the name to errors.DOCUMENTED: {missing}"
    dangling = sorted(name for name in DOCUMENTED if f"### `{name}`" not in text)
    assert not dangling, f"errors.DOCUMENTED names classes without a section: {dangling}"


def test_the_pages_own_links_lead_to_its_headings():
    text = PAGE.read_text()
    anchors = _anchors(text)
    assert "lowmemorywarning" in anchors and "out-of-memory-binder-small-machines" in anchors
    inside = re.findall(r"\]\(#([^)]+)\)", text)
    assert inside and not [a for a in inside if a not in anchors]


@pytest.mark.parametrize("name", [n for n in PUBLIC if issubclass(getattr(wb, n), Exception)
                                  and not issubclass(getattr(wb, n), Warning)])
def test_an_errors_traceback_links_to_its_section(name):
    kind = getattr(wb, name)
    error = kind("what failed, why, what to do")
    anchor = help_url(kind).split("#", 1)[1]
    assert getattr(error, "__notes__", []) == [f"help: {HELP_PAGE}#{anchor}"]
    assert anchor == name.lower() and anchor in _anchors(PAGE.read_text())
    assert str(error) == "what failed, why, what to do"  # the message itself stays as written (it is quoted in others)
    assert wb.errors.described(error).splitlines() == [str(error), error.__notes__[0]]


@pytest.mark.parametrize("name", [n for n in PUBLIC if issubclass(getattr(wb, n), Warning)])
def test_a_warnings_message_links_to_its_section(name):
    kind = getattr(wb, name)
    assert issubclass(kind, wb.WorkbenchWarning) and issubclass(kind, UserWarning)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("something to know", kind, stacklevel=1)
    (shown,) = [str(w.message) for w in caught]
    assert shown == f"something to know (help: {HELP_PAGE}#{name.lower()})"


def test_an_internal_error_links_to_its_nearest_documented_base():
    from workbench.cluster.process.connection import TaskUnreachable

    assert help_url(TaskUnreachable).endswith("#clusterstateerror")
    assert help_url(ValueError) == HELP_PAGE


def test_a_notice_from_a_workbench_thread_names_its_source_once_and_no_file():
    from workbench.native_logs import notice

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        notice("worker:1 failed a call at step 3: re-hosting it", wb.TaskFaultWarning, "job async-ps-5")
        notice("job async-ps-5: worker:1 is back after 1.2 s", wb.TaskFaultWarning, "job async-ps-5")
        warnings.warn_explicit("elsewhere", UserWarning, "script.py", 7)  # any other warning keeps Python's format
    # as Python shows each one (showwarning formats with warnings.formatwarning)
    lines = [warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line).rstrip() for w in seen]
    assert lines[0].startswith("TaskFaultWarning: job async-ps-5: worker:1 failed a call at step 3: re-hosting it")
    assert lines[1].startswith("TaskFaultWarning: job async-ps-5: worker:1 is back after 1.2 s")
    assert lines[2] == "script.py:7: UserWarning: elsewhere"
