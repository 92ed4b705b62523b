"""What every live plot shares: Bokeh required with a clear error, how often plots update and read, a clock
axis, plots that fill the height of a page of their own, and lines of text that change at a readable pace."""

from __future__ import annotations

DEFAULT_INTERVAL = 0.25  # seconds between updates (widget and server apps): a step's bar appears within about this
EVENTS_PER_UPDATE = 20_000  # a long backlog is streamed over several updates, none of them long
TEXT_INTERVAL = 1.0  # seconds between changes of a live line of text (figures now, steps done, ETA)


def require_bokeh():
    from .. import optional

    return optional.require("bokeh", "the dashboards")


def clock_axis(plot) -> None:
    """Time of day on the x axis at every zoom (Bokeh's default labels a short span "0ms 200ms ... 0ms")."""
    from bokeh.models import DatetimeTickFormatter

    plot.xaxis.formatter = DatetimeTickFormatter(
        microseconds="%H:%M:%S.%3N", milliseconds="%H:%M:%S.%3N", seconds="%H:%M:%S", minsec="%H:%M:%S",
        minutes="%H:%M", hourmin="%H:%M", hours="%H:%M", context=None)
    plot.xaxis.ticker.desired_num_ticks = 5  # a label is 8 to 12 characters wide: fewer, and none overlap


class LiveText:
    """A Bokeh ``Div`` whose figures change at most once per ``TEXT_INTERVAL``; a change of what it is about shows at once.

    BokehJS lays out and repaints the whole document whenever a ``Div``'s text changes: two lines of figures
    rewritten at every update (4 a second) kept a browser's main thread busy drawing the dashboard beside a
    training job. Once a second is as fast as anyone reads a number; a new job or one that ended (``about``)
    is not held back.
    """

    def __init__(self, div):
        self.div = div
        self._shown_at = float("-inf")
        self._about = None

    def show(self, text: str, now: float, about=None) -> None:
        """Show ``text`` if the last change is ``TEXT_INTERVAL`` old (``now``: seconds) or ``about`` changed."""
        if text == self.div.text:
            return
        if about != self._about or now - self._shown_at >= TEXT_INTERVAL:
            self.div.text = text
            self._shown_at, self._about = now, about


def stretch(root, plots) -> None:
    """Let ``plots`` (and the layouts around them, ``root`` down) fill the height of a page of their own."""
    from bokeh.models import LayoutDOM

    for plot in plots:
        plot.min_height = plot.height
        plot.sizing_mode = "stretch_both"
    stack = [root]
    while stack:  # the rows and columns that hold them; a legend or a figure's text keeps its height
        layout = stack.pop()
        if isinstance(layout, LayoutDOM) and hasattr(layout, "children") and layout not in plots:
            layout.sizing_mode = "stretch_both"
            stack.extend(layout.children)
