"""Calls on engines through ipyparallel, bounded in time: ``run_on_engines`` with a shared ``Deadline`` (or its two
halves, ``start_on_engines`` and ``await_engines``, to send the next calls before the last ones answered).

Also ``LoopThread``: an asyncio loop of the workbench's own, to drive ipyparallel's async API with
timeouts the same way in a script and inside Jupyter's running loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from typing import Any


class Deadline:
    """A time budget shared by the steps of one operation."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def remaining(self, floor: float = 0.0) -> float:
        return max(floor, self._end - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self._end


class RemoteCallFailed(Exception):
    """A function run on an engine raised; ``engine`` and a one-line ``reason`` say which and why."""

    def __init__(self, engine: int, exc: BaseException):
        self.engine = engine
        self.reason = f"{getattr(exc, 'ename', type(exc).__name__)}: {getattr(exc, 'evalue', exc)}"
        super().__init__(f"engine {engine}: {self.reason}")


class RemoteCallsTimedOut(Exception):
    """Some engines did not answer before the deadline; ``pending`` lists them."""

    def __init__(self, pending: list[int]):
        self.pending = pending
        super().__init__(f"engines {pending} did not answer")


def run_on_engines(client, calls: dict[int, tuple], deadline: Deadline, on_progress=None, poll: float = 0.05) -> dict:
    """Run ``{engine_id: (function, *args)}`` on the engines at once; results by engine id.

    The one way the workbench calls its engines (``start_on_engines`` then ``await_engines``, for a caller
    that sends its next calls before the last ones answered): raises ``RemoteCallFailed`` for the first engine
    that fails and ``RemoteCallsTimedOut`` when the deadline passes; callers turn those into messages about
    what they were doing.
    """
    return await_engines(start_on_engines(client, calls), deadline, on_progress, poll)


def start_on_engines(client, calls: dict[int, tuple]) -> dict:
    """Send ``{engine_id: (function, *args)}`` to the engines; what ``await_engines`` waits on. An engine runs
    what it is sent in order: a call sent while its last one runs starts the moment that one ends."""
    return {eid: client[eid].apply_async(fn, *args) for eid, (fn, *args) in calls.items()}


def await_engines(sent: dict, deadline: Deadline, on_progress=None, poll: float = 0.05) -> dict:
    """The results of calls ``start_on_engines`` sent, by engine id (see ``run_on_engines``).

    It returns as soon as the last engine answers (waiting on an answer wakes on its arrival);
    ``on_progress(done, total)`` and the deadline are looked at on each answer and every ``poll`` seconds between.
    """
    pending = dict(sent)
    results: dict = {}
    while pending:
        for eid in [e for e, ar in pending.items() if ar.ready()]:
            try:
                results[eid] = pending.pop(eid).get(timeout=0)
            except Exception as exc:  # noqa: BLE001 - becomes RemoteCallFailed naming the engine
                raise RemoteCallFailed(eid, exc) from None
        if on_progress is not None:
            on_progress(len(results), len(sent))
        if pending and deadline.expired:
            raise RemoteCallsTimedOut(sorted(pending))
        if pending:
            next(iter(pending.values())).wait(min(poll, deadline.remaining()))
    return results


class LoopThread:
    """An asyncio loop in a daemon thread, to drive ipyparallel's async cluster API with timeouts.

    Using our own thread works the same in a script and inside Jupyter's running loop.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="workbench-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine, timeout: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()
