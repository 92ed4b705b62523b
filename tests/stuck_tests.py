"""A watchdog for a test stuck where pytest-timeout cannot reach it, so that CI says which test and goes on.

pytest-timeout (signal method) interrupts a test waiting in Python. A test blocked inside one C call (a
TensorFlow op waiting for a task that never answers, a gRPC connect) never returns to the interpreter,
so that signal's handler never runs, and the suite would hang until CI's own limit, whose log keeps only
its last lines. This plugin's thread watches each phase (setup, call, teardown) of each test. When a phase
runs past its limit it:

1. prints which test and phase is stuck and every thread's stack, and ends with the test's id (the tail
   of a cut log then still says it);
2. ends every process this test process started (engines, controllers, Jupyter, Chromium, Slurm): a call
   blocked on one of them then fails, the test fails with a report, and the suite goes on;
3. if that phase still has not ended ``EXIT_AFTER`` seconds later, says so and exits (code 3).

A stuck thread that holds the GIL would also stop this thread: faulthandler's own thread (armed for each
phase, a little after this one) then dumps every stack and exits.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback

import psutil
import pytest

from workbench.cluster.launch.reaper import kill_process_trees

# A phase's limit, past pytest-timeout's 600 s for the whole test. Setup is longer: session fixtures build
# a Binder environment (pip, a JupyterLab build) or install Slurm, each under its own subprocess timeouts.
LIMITS = {"setup": 2400.0, "call": 900.0, "teardown": 900.0}
LIMITS_ENV = "WORKBENCH_TEST_PHASE_LIMITS"  # e.g. "call=5,teardown=5": this plugin's own test
EXIT_AFTER = 120.0
C_BACKSTOP_AFTER = 240.0  # faulthandler's dump-and-exit, for a stuck thread that holds the GIL
POLL_SECONDS = 5.0


class _Watch:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phase: tuple[str, str, float, float] | None = None  # nodeid, phase, started, limit
        self._serial = 0
        thread = threading.Thread(target=self._run, name="test-watchdog", daemon=True)
        thread.start()

    def begin(self, nodeid: str, phase: str) -> None:
        limit = _limits()[phase]
        with self._lock:
            self._serial += 1
            self._phase = (nodeid, phase, time.monotonic(), limit)
        faulthandler.dump_traceback_later(limit + EXIT_AFTER + C_BACKSTOP_AFTER, exit=True, file=sys.__stderr__)

    def end(self) -> None:
        with self._lock:
            self._serial += 1
            self._phase = None
        faulthandler.cancel_dump_traceback_later()

    def _run(self) -> None:
        acted = -1  # the serial of the phase already acted on
        while True:
            time.sleep(POLL_SECONDS)
            with self._lock:
                serial, phase = self._serial, self._phase
            if phase is None or serial == acted or time.monotonic() - phase[2] < phase[3]:
                continue
            acted = serial
            self._unstick(*phase)
            deadline = time.monotonic() + EXIT_AFTER
            while time.monotonic() < deadline and self._serial == serial:
                time.sleep(1.0)
            if self._serial == serial:
                _say(f"WATCHDOG: {phase[0]} ({phase[1]}) is still stuck {EXIT_AFTER:.0f} s after its processes "
                     "were ended; exiting with code 3")
                os._exit(3)

    @staticmethod
    def _unstick(nodeid: str, phase: str, started: float, limit: float) -> None:
        _say(f"\nWATCHDOG: {nodeid} ({phase}) has run {time.monotonic() - started:.0f} s (limit {limit:.0f} s). "
             "Every thread's stack:")
        faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        where = _innermost(threading.main_thread().ident)
        names, pairs = [], []
        for child in psutil.Process().children(recursive=True):
            try:
                names.append(f"{child.pid} {child.name()}")
                pairs.append((child.pid, child.create_time()))
            except psutil.Error:
                continue  # gone already
        _say(f"WATCHDOG: ending the {len(pairs)} process(es) this test run started ({', '.join(names)}) "
             f"so that {nodeid} ({phase}) fails instead of hanging")
        kill_process_trees(pairs)
        _say(f"WATCHDOG: stuck: {nodeid} ({phase}), the main thread was in (innermost last):\n{where}")


def _innermost(thread_id: int, frames: int = 8) -> str:
    frame = sys._current_frames().get(thread_id)
    stack = traceback.format_stack(frame)[-frames:] if frame is not None else ["  (gone)\n"]
    return "".join(stack).rstrip()


def _limits() -> dict[str, float]:
    limits = dict(LIMITS)
    for part in filter(None, os.environ.get(LIMITS_ENV, "").split(",")):
        phase, _, seconds = part.partition("=")
        limits[phase.strip()] = float(seconds)
    return limits


def _say(text: str) -> None:
    sys.__stderr__.write(text + "\n")
    sys.__stderr__.flush()


_WATCH: _Watch | None = None


def pytest_configure(config) -> None:
    global _WATCH
    _WATCH = _Watch()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    _WATCH.begin(item.nodeid, "setup")
    yield
    _WATCH.end()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _WATCH.begin(item.nodeid, "call")
    yield
    _WATCH.end()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    _WATCH.begin(item.nodeid, "teardown")
    yield
    _WATCH.end()
