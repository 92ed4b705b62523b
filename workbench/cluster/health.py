"""What the owner of a cluster knows about its tasks' health, as it happens.

The reaper (``reaper.py``) hears from every engine over its lifeline: an engine whose connection
closed is gone (``lost``), one that stopped answering pings is ``silent`` (stopped, frozen, cut
off), and answers again when it comes back. ``TaskHealth`` follows those reports in a thread, keeps
each task's record (``cluster.tasks``, ``cluster.status()``, the registry the panel reads) in step
within a second, writes a ``TaskEvent`` into the cluster's telemetry for the dashboards, and tells
its subscribers (training jobs, which recover from it).

A task's states: ``starting`` -> ``running`` <-> ``silent``; ``lost`` (engine gone) ->
``recovering`` (being re-hosted) -> ``running``; ``stopped`` when its cluster stops.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from ..telemetry.events import TaskEvent
from .status import TaskRecord

STARTING, RUNNING, SILENT, LOST, RECOVERING, STOPPED = "starting", "running", "silent", "lost", "recovering", "stopped"
ENGINE_EXITED = "its engine exited"  # the note of a task whose engine's lifeline closed: the process is gone
CONTROLLER_LOST = "controller-lost"  # the kind of the event that tells subscribers the whole cluster is gone

Subscriber = Callable[[TaskEvent], None]


class TaskHealth:
    """The task records' health, followed from the reaper's reports and told to subscribers.

    ``records()`` returns the current task records; ``publish()`` persists them (the registry);
    ``telemetry`` is the cluster's event log.
    """

    def __init__(self, name: str, records: Callable[[], Iterable[TaskRecord]], publish: Callable[[], None], telemetry):
        self.name = name
        self._records = records
        self._publish = publish
        self._telemetry = telemetry
        self._subscribers: list[Subscriber] = []
        self._lock = threading.Lock()
        self._states = threading.Lock()  # one state change at a time: its check, its change and its event together
        self._controller_pids: set[int] = set()
        self._on_controller_lost: Callable[[str], None] | None = None
        self.closing = False  # set while the cluster stops: the engines it kills are not "lost"
        self._thread: threading.Thread | None = None

    # -- what subscribers get ------------------------------------------------------------

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Call ``subscriber(event)`` for every health event (in the monitor's thread: do not block); returns unsubscribe."""
        with self._lock:
            self._subscribers.append(subscriber)

        def unsubscribe() -> None:
            with self._lock:
                if subscriber in self._subscribers:
                    self._subscribers.remove(subscriber)

        return unsubscribe

    def _tell(self, event: TaskEvent) -> None:
        self._telemetry.append(event)
        self._notify(event)

    def _notify(self, event: TaskEvent) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for subscriber in subscribers:
            try:
                subscriber(event)
            except Exception:  # noqa: BLE001 - one subscriber's bug must not stop the others or the monitor
                pass

    def set_state(self, record: TaskRecord, state: str, note: str = "", since: float | None = None,
                  only_from: tuple[str, ...] | None = None) -> bool:
        """Move ``record`` to ``state`` (saying why in ``note``), persist it, and tell everyone.

        With ``only_from``, only a record in one of those states moves (checked and changed at once, so a
        re-hosting that began meanwhile is not overwritten by a late report); returns whether it moved.
        """
        with self._states:
            if only_from is not None and record.state not in only_from:
                return False
            record.state, record.note = state, note
            record.since = time.time() if since is None else since
            event = TaskEvent(record.name, state, record.since, note)
            self._telemetry.append(event)  # in the order the states changed
        self._publish()
        self._notify(event)
        return True

    def flag(self, task: str, kind: str, detail: str, job: str = "") -> None:
        """A finding about a task that does not change its state (a job's straggler, a dropped gradient...)."""
        self._tell(TaskEvent(task, kind, time.time(), detail, job))

    # -- following the reaper --------------------------------------------------------------

    def follow(self, events: Iterable[dict], controller_pids: Iterable[int], on_controller_lost: Callable[[str], None]) -> None:
        """Start following the reaper's ``events`` in a daemon thread; ``on_controller_lost`` runs once if the controller exits."""
        self._controller_pids = set(controller_pids)
        self._on_controller_lost = on_controller_lost
        self._thread = threading.Thread(target=self._follow, args=(events,), daemon=True, name=f"workbench-health-{self.name}")
        self._thread.start()

    def _follow(self, events: Iterable[dict]) -> None:
        for event in events:
            if self.closing:
                continue  # read on until the reaper exits: it must never block writing to us
            try:
                self._handle(event)
            except Exception:  # noqa: BLE001 - a malformed report must not end the monitoring
                pass

    def _find(self, pid: int, host: str) -> TaskRecord | None:
        return next((r for r in self._records() if r.pid == pid and (not host or r.host == host)), None)

    def _handle(self, event: dict) -> None:
        kind, pid = event.get("event"), int(event.get("pid", 0))
        if kind == "exited":
            if pid in self._controller_pids and self._on_controller_lost is not None:
                callback, self._on_controller_lost = self._on_controller_lost, None
                callback(f"the controller of cluster {self.name!r} (pid {pid}) exited")
            return
        record = self._find(pid, str(event.get("host", "")))
        if record is None:
            return  # an engine the cluster no longer counts (scaled down, or already replaced)
        if kind == "lost":
            self.set_state(record, LOST, ENGINE_EXITED, only_from=(STARTING, RUNNING, SILENT))
        elif kind == "silent":
            seconds = float(event.get("seconds", 0.0))
            self.set_state(record, SILENT, "not answering", since=time.time() - seconds, only_from=(RUNNING,))
        elif kind == "alive":
            self.set_state(record, RUNNING, "answering again", only_from=(SILENT,))

    def controller_lost(self, reason: str) -> None:
        """Tell subscribers that the whole cluster is gone (``CONTROLLER_LOST``)."""
        self._tell(TaskEvent("controller", CONTROLLER_LOST, time.time(), reason))
