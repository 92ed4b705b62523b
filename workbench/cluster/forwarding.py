"""An attached process's jobs reach the owner's telemetry, so the owner's dashboards and the panel show them.

``wb.attach`` starts a ``TelemetryForwarder``: a thread that, every half second, sends the job events
this process recorded for the cluster (step spans, completed steps, progress) to the owner's control
endpoint (``POST /telemetry``, with the token of the owner's registry record). It stops with the
attached object; an owner that does not answer costs a warning-free retry, never the job.
"""

from __future__ import annotations

import os
import threading
import urllib.error

from ..telemetry.wire import MAX_EVENTS, encode
from . import registry

INTERVAL_SECONDS = 0.5
REQUEST_TIMEOUT = 5.0


class TelemetryForwarder:
    def __init__(self, cluster):
        self.cluster = cluster
        self.cursor = 0
        self._control = None  # the owner's control endpoint, from its registry record (read again after a failure)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"workbench-forward-{cluster.name}")

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
        batch = self.cluster.telemetry.since(self.cursor, MAX_EVENTS)
        items = encode(batch.events, f"pid {os.getpid()}")
        if items and not self._send(items):
            return  # the owner may be stopping: the same events again next time
        self.cursor = batch.cursor

    def _send(self, items: list) -> bool:
        if self._control is None:
            record = registry.read_record(self.cluster.name)
            self._control = record.endpoints.get("control") if record is not None else None
            if self._control is None:
                return False
        try:
            self._control.request("POST", "telemetry", {"events": items}, REQUEST_TIMEOUT)
            return True
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError):
            self._control = None
            return False
