"""What every live plot shares: Bokeh required with a clear error, how often plots update and read, a clock
axis, and plots that fill the height of a page of their own."""

from __future__ import annotations

DEFAULT_INTERVAL = 0.25  # seconds between updates (widget and server apps): a step's bar appears within about this
EVENTS_PER_UPDATE = 20_000  # a long backlog is streamed over several updates, none of them long


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
