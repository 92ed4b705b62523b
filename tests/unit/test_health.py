"""A task's state follows the reaper's reports and the re-hostings, in the order they happened."""

import random
import sys
import threading
import time

from workbench.cluster.health import ENGINE_EXITED, LOST, RECOVERING, RUNNING, TaskHealth
from workbench.cluster.status import TaskRecord
from workbench.telemetry.events import TaskEvent
from workbench.telemetry.log import EventLog

PID = 4242


def _health(record: TaskRecord, publish=lambda: None) -> tuple[TaskHealth, EventLog]:
    log = EventLog()
    return TaskHealth("health-test", lambda: [record], publish, log), log


def _write_registry() -> None:
    time.sleep(random.uniform(0, 0.003))  # a cluster persists its records on every change: a file written, in its own time


def _states(log: EventLog) -> list[str]:
    return [e.kind for e in log.since(0).events if isinstance(e, TaskEvent)]


def _report_then_signal(report: dict, done: threading.Event, start: threading.Barrier | None = None):
    if start is not None:
        start.wait(10)
    yield report
    done.set()  # the monitor asks for the next report only once it has handled this one


def test_an_engines_exit_marks_its_running_task_lost_and_says_why():
    record = TaskRecord("worker", 1, 2, "", pid=PID, state=RUNNING)
    health, log = _health(record)
    done = threading.Event()
    health.follow(_report_then_signal({"event": "lost", "pid": PID}, done), [], lambda reason: None)
    assert done.wait(10)
    assert (record.state, record.note) == (LOST, ENGINE_EXITED)
    assert _states(log) == [LOST]


def test_a_late_exit_report_never_overwrites_a_rehosting_under_way():
    # the job re-hosts a worker the moment a call to it fails; the reaper's report of the same exit may
    # arrive at the same moment. Whatever the order, the task ends "recovering" and its events say so last.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads change hands often: the two reports meet in every order
    try:
        _race_a_report_and_a_rehosting(100)
    finally:
        sys.setswitchinterval(interval)


def _race_a_report_and_a_rehosting(rounds: int) -> None:
    for _ in range(rounds):
        record = TaskRecord("worker", 1, 2, "", pid=PID, state=RUNNING)
        health, log = _health(record, _write_registry)
        done, start = threading.Event(), threading.Barrier(2)
        health.follow(_report_then_signal({"event": "lost", "pid": PID}, done, start), [], lambda reason: None)
        start.wait(10)
        time.sleep(random.uniform(0, 0.0005))  # the report and the re-hosting meet in every order
        health.set_state(record, RECOVERING, "starting a new engine")
        assert done.wait(10)
        states = _states(log)
        assert record.state == RECOVERING and states[-1] == RECOVERING, states
        assert states in ([RECOVERING], [LOST, RECOVERING]), states


def test_a_conditional_change_reports_whether_it_happened():
    record = TaskRecord("ps", 0, 0, "", pid=PID, state=RECOVERING)
    health, log = _health(record)
    assert not health.set_state(record, LOST, ENGINE_EXITED, only_from=(RUNNING,))
    assert record.state == RECOVERING and _states(log) == []
    assert health.set_state(record, RUNNING, "re-hosted", only_from=(RECOVERING,))
    assert record.state == RUNNING and _states(log) == [RUNNING]
