"""The kernel-side ring buffer every dashboard reads from.

Producers (training jobs, the profiler) append; each reader keeps a cursor, the monotonic index
of the next event it has not seen, and asks for what came after it. The buffer keeps the newest
``capacity`` events: a reader that fell further behind is told how many it missed.

In-progress step spans are kept apart (``in_progress()``): there are at most a few per worker,
and a completed span with the same key replaces its in-progress one.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice

from .events import StepSpan

DEFAULT_CAPACITY = 100_000


@dataclass(frozen=True)
class Batch:
    """What a reader gets: new events, the cursor to ask with next time, and events it missed."""

    events: list
    cursor: int
    missed: int = 0


class EventLog:
    """A thread-safe ring buffer of events with a monotonic index."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if int(capacity) < 1:
            raise ValueError(f"capacity={capacity!r}: an event log keeps at least one event.")
        self.capacity = int(capacity)
        self._events: deque = deque(maxlen=self.capacity)
        self._next = 0  # the index the next appended event gets
        self._open: dict[str, StepSpan] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)

    @property
    def cursor(self) -> int:
        """The index the next event will get (a reader that starts here sees only new events)."""
        with self._lock:
            return self._next

    def extend(self, events: Iterable) -> None:
        """Append events; a completed ``StepSpan`` closes the in-progress span with its key."""
        events = list(events)
        if not events:
            return
        with self._lock:
            for event in events:
                if isinstance(event, StepSpan) and event.key:
                    if event.end is None:
                        self._open[event.key] = event
                        continue
                    self._open.pop(event.key, None)
                self._events.append(event)
                self._next += 1

    def append(self, event) -> None:
        self.extend([event])

    def close(self, key: str) -> None:
        """Forget an in-progress span that will not complete (its call failed or was given up on)."""
        with self._lock:
            self._open.pop(key, None)

    def in_progress(self) -> list[StepSpan]:
        with self._lock:
            return list(self._open.values())

    def since(self, cursor: int, limit: int | None = None) -> Batch:
        """Events from index ``cursor`` on (at most ``limit``, oldest first)."""
        with self._lock:
            first = self._next - len(self._events)
            missed = max(0, first - cursor)
            start = max(cursor, first)
            stop = self._next if limit is None else min(self._next, start + limit)
            if start >= stop:
                return Batch([], max(cursor, stop), missed)
            # readers mostly want the newest events: walk from the right end of the deque then
            count, from_end = stop - start, self._next - stop
            if from_end == 0:
                tail = list(islice(reversed(self._events), count))[::-1]
            else:
                tail = list(islice(self._events, start - first, stop - first))
            return Batch(tail, stop, missed)
