"""Progress of long operations: tqdm's bar, a widget in a notebook and text in a terminal.

The cluster reports ``update(phase, done, total)``; the sink decides how to show it. Sinks are
injected (``Cluster(progress=...)``), so tests and other front ends can pass their own.
"""

from __future__ import annotations

from typing import Protocol


class ProgressSink(Protocol):
    def update(self, phase: str, done: int, total: int) -> None: ...

    def close(self, message: str, ok: bool = True) -> None: ...


class NullProgress:
    def update(self, phase: str, done: int, total: int) -> None:
        pass

    def close(self, message: str, ok: bool = True) -> None:
        pass


class BarProgress:
    """A tqdm bar per phase: tqdm's notebook widget in Jupyter, a text bar in a terminal (``tqdm.auto``).

    ``close(message)`` ends the bar with the message as its label; a failure turns it red.
    """

    def __init__(self, **tqdm_options) -> None:
        self._options = {"leave": True, "unit": "", "dynamic_ncols": True, **tqdm_options}
        self._bar = None
        self._phase: str | None = None

    def _open(self, phase: str, total: int) -> None:
        from tqdm.auto import tqdm

        if self._bar is not None:
            self._bar.close()
        self._bar, self._phase = tqdm(total=total, desc=phase, **self._options), phase

    def update(self, phase: str, done: int, total: int) -> None:
        if self._bar is None or phase != self._phase:
            self._open(phase, total)
        if (self._bar.n, self._bar.total) != (done, total):
            self._bar.total, self._bar.n = total, done
            self._bar.refresh()

    def close(self, message: str, ok: bool = True) -> None:
        if self._bar is None:
            self._open(message, 1)
        bar, self._bar = self._bar, None
        bar.set_description_str(message, refresh=False)
        if ok:
            bar.n = bar.total or bar.n
        else:
            bar.colour = "red"
        bar.close()


def make_progress(progress: bool | ProgressSink) -> ProgressSink:
    """``True``: a tqdm bar (a widget in a notebook, text elsewhere); ``False``: nothing; a sink: itself."""
    if progress is False or progress is None:
        return NullProgress()
    if progress is not True:
        return progress
    return BarProgress()
