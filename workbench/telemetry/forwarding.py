"""An attached process's jobs reach the owner's telemetry, so the owner's dashboards and the panel show them.

``wb.attach`` starts a ``TelemetryForwarder``: a thread that, every half second, sends the job events
this process recorded for the cluster (step spans, completed steps, progress) to the owner's control
endpoint (``POST /telemetry``, with the token of the owner's registry record). It stops with the
attached object; an owner that does not answer costs a warning-free retry, never the job.

The cluster hands it a ``find_endpoint`` function (the registry lookup), so telemetry does not
import the cluster package that uses it.
"""

from __future__ import annotations

import os
import threading
import urllib.error
from collections.abc import Callable
from typing import Any

from .log import EventLog
from .wire import MAX_EVENTS, encode

INTERVAL_SECONDS = 0.5
REQUEST_TIMEOUT = 5.0


class TelemetryForwarder:
    """Sends ``telemetry``'s events to the endpoint ``find_endpoint()`` returns (``None``: not there yet)."""

    def __init__(self, name: str, telemetry: EventLog, find_endpoint: Callable[[], Any]):
        self.telemetry = telemetry
        self.find_endpoint = find_endpoint
        self.cursor = 0
        self._control = None  # the owner's control endpoint (looked up again after a failure)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"workbench-forward-{name}")

    def start(self) -> TelemetryForwarder:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(REQUEST_TIMEOUT + 1)
        self.flush()  # what the last half second recorded

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_SECONDS):
            self.flush()

    def flush(self) -> None:
        batch = self.telemetry.since(self.cursor, MAX_EVENTS)
        items = encode(batch.events, f"pid {os.getpid()}")
        if items and not self._send(items):
            return  # the owner may be stopping: the same events again next time
        self.cursor = batch.cursor

    def _send(self, items: list) -> bool:
        if self._control is None:
            self._control = self.find_endpoint()
            if self._control is None:
                return False
        try:
            self._control.request("POST", "telemetry", {"events": items}, REQUEST_TIMEOUT)
            return True
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError):
            self._control = None
            return False
