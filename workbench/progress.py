"""Progress of long operations: a bar in a notebook, lines of text in a terminal.

The cluster reports ``update(phase, done, total)``; the sink decides how to show it. Sinks are
injected (``Cluster(progress=...)``), so tests and other front ends can pass their own.
"""

from __future__ import annotations

import sys
import time
from typing import Protocol, TextIO


class ProgressSink(Protocol):
    def update(self, phase: str, done: int, total: int) -> None: ...

    def close(self, message: str, ok: bool = True) -> None: ...


class NullProgress:
    def update(self, phase: str, done: int, total: int) -> None:
        pass

    def close(self, message: str, ok: bool = True) -> None:
        pass


class TextProgress:
    """One line per change of phase or count, e.g. ``[ 4.1s] engines registered 2/3``."""

    def __init__(self, stream: TextIO | None = None):
        self._stream = stream or sys.stderr
        self._started = time.monotonic()
        self._last: tuple[str, int, int] | None = None

    def _write(self, text: str) -> None:
        print(f"[{time.monotonic() - self._started:5.1f}s] {text}", file=self._stream, flush=True)

    def update(self, phase: str, done: int, total: int) -> None:
        if (phase, done, total) != self._last:
            self._last = (phase, done, total)
            self._write(f"{phase} {done}/{total}")

    def close(self, message: str, ok: bool = True) -> None:
        self._write(message)


class WidgetProgress:
    """An ipywidgets bar with the phase as its label."""

    def __init__(self) -> None:
        import ipywidgets
        from IPython.display import display

        self._started = time.monotonic()
        self._bar = ipywidgets.IntProgress(value=0, min=0, max=1, bar_style="info")
        self._label = ipywidgets.HTML("starting…")
        self._box = ipywidgets.HBox([self._bar, self._label])
        display(self._box)

    def update(self, phase: str, done: int, total: int) -> None:
        self._bar.max = max(total, 1)
        self._bar.value = done
        self._label.value = f"{phase} {done}/{total} ({time.monotonic() - self._started:.1f} s)"

    def close(self, message: str, ok: bool = True) -> None:
        self._bar.value = self._bar.max
        self._bar.bar_style = "success" if ok else "danger"
        self._label.value = message


def in_notebook() -> bool:
    """True inside a Jupyter kernel that has a front end able to show widgets."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def make_progress(progress: bool | ProgressSink) -> ProgressSink:
    """``True``: a widget in a notebook, text elsewhere; ``False``: nothing; a sink: itself."""
    if progress is False or progress is None:
        return NullProgress()
    if progress is not True:
        return progress
    if in_notebook():
        try:
            return WidgetProgress()
        except ImportError:
            pass
    return TextProgress()
