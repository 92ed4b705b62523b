"""What the end of `make test`'s output says about each part: its failed tests, or the signal that ended it."""

import signal

import run_suite

_REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.integration.test_x" name="test_passes"/>
<testcase classname="tests.integration.test_x" name="test_fails"><failure message="AssertionError: 1 != 2"/></testcase>
</testsuite></testsuites>"""


def test_a_failed_test_is_named_with_its_part_and_message(tmp_path):
    (tmp_path / "junit-environment.xml").write_text(_REPORT)
    lines = run_suite.failures({"environment": 1}, tmp_path)
    assert lines == ["run_suite: [environment] FAILURE tests.integration.test_x::test_fails - AssertionError: 1 != 2"]


def test_a_part_ended_by_a_signal_says_which_and_where_its_log_stopped(tmp_path):
    progress = [f"tests/integration/test_{n}.py ....  [{n}%]" for n in range(20)]
    (tmp_path / "pytest-core.log").write_text("\n".join([*progress, "tests/integration/test_stuck.py .."]) + "\n")
    lines = run_suite.failures({"core": -signal.SIGTERM, "quiet": 0}, tmp_path)
    assert lines[0] == "run_suite: [core] ENDED BY SIGTERM before it wrote its report; the last lines of pytest-core.log:"
    assert lines[-1] == "run_suite: [core]   tests/integration/test_stuck.py .."
    assert len(lines) == 1 + run_suite.LOG_LINES_SHOWN  # its last lines only, each marked with its part
