"""The scales of the cluster a running job follows (``cluster.scale`` while it trains).

A scale is a request (the workers leaving, an event set once the job let them go, when it was asked)
that waits for the job's next step boundary; the job takes the requests there, follows them, and
records each change of its workers (``job.events``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ...errors import ClusterStateError
from ...native_logs import inform

Request = tuple[tuple[str, ...], threading.Event, float]  # (workers leaving, done, asked at)


class Scales:
    """A job's scale requests not followed yet, and the changes of workers it made; ``lock`` is the job's."""

    def __init__(self, lock: threading.Lock):
        self._lock = lock
        self._pending: list[Request] = []
        self._events: list[dict] = []

    def ask(self, leaving: tuple[str, ...], timeout: float, describe: Callable[[], str]) -> None:
        """Add a request; with ``leaving``, wait until the job let those workers go (or withdraw it and raise)."""
        request = (leaving, threading.Event(), time.time())
        with self._lock:
            self._pending.append(request)
        if not leaving:
            return
        try:
            if request[1].wait(timeout):
                return
        except KeyboardInterrupt:  # the scale is given up: its workers stay, and the job keeps them if it can
            self._withdraw(request)
            raise
        if not self._withdraw(request):  # taken while the wait ended: the job is letting them go now
            request[1].wait(60.0)
            return
        raise ClusterStateError(
            f"{describe()} did not let {', '.join(leaving)} go within {timeout:.0f} s (a call on it has not come "
            "back): the workers stay. Check cluster.status(), then scale again, or stop the job first.")

    def _withdraw(self, request: Request) -> bool:
        """Take back a request the job has not followed yet; False if it is being (or was) followed."""
        with self._lock:
            if request in self._pending:
                self._pending.remove(request)
                return True
        return False

    def pending(self) -> bool:
        return bool(self._pending)

    def take(self) -> list[Request]:
        """The requests to follow now (at a step boundary, or the job's end)."""
        with self._lock:
            taken, self._pending = self._pending, []
        return taken

    def record(self, requests: list[Request], before: list[str], after: list[str], drained: float, pause: float,
               step: int, when: str, job: str) -> None:
        """Add a change of workers to the events and say it in one line (information: the user asked for it)."""
        event = {"kind": "scale", "time": drained, "step": step, "workers": after,
                 "joined": [n for n in after if n not in before], "left": [n for n in before if n not in after],
                 "drain_seconds": max(0.0, drained - min((asked for _n, _d, asked in requests), default=drained)),
                 "pause_seconds": pause}
        with self._lock:
            self._events.append(event)
        changes = "; ".join(f"{what}: {', '.join(event[what])}" for what in ("joined", "left") if event[what])
        paused = f"; paused {pause:.1f} s" if pause else ""
        inform(f"{len(after)} worker(s) {when} ({changes}{paused})", f"job {job}")

    def events(self) -> list[dict]:
        with self._lock:
            return [dict(event) for event in self._events]

    def follow(self, job, drained: float) -> None:
        """Follow the requests at ``job``'s step boundary: its trainer takes the cluster's workers less those leaving
        (``Trainer.follow_scale``), and the change is recorded; the requests' waits end, done or failed."""
        requests = self.take()
        try:
            before = [r.name for r in job.workers]
            if job.trainer.follow_scale(_leaving(requests)):
                step = job.start_step + job.steps_done
                self.record(requests, before, [r.name for r in job.workers], drained, time.time() - drained, step,
                            f"from step {step}", job.name)
                job.report_progress()
        finally:
            for _names, done, _asked in requests:
                done.set()

    def note_after_end(self, requests: list[Request], job) -> None:
        """Requests that came in ``job``'s last steps: nothing was left to follow with; the change is recorded."""
        if not requests:
            return
        leaving = _leaving(requests)
        before = [r.name for r in job.workers]
        after = [r.name for r in job.cluster.tasks if r.job == "worker" and r.name not in leaving]
        if after != before:
            self.record(requests, before, after, time.time(), 0.0, job.start_step + job.steps_done,
                        "after its last step", job.name)


def _leaving(requests: list[Request]) -> set[str]:
    return {name for names, _done, _asked in requests for name in names}
