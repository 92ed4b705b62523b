"""An op-level profile drawn with the timeline component: ops as bars, Send/Recv pairs linked."""

from __future__ import annotations

from collections.abc import Iterable

from ..telemetry.events import OpEvent

OP_COLUMNS = ("row", "left", "right", "name", "op_type", "task", "duration_us", "kind")
KINDS = ("op", "send", "recv")
KIND_COLOURS = ("#1f77b4", "#d62728", "#2ca02c")


def op_kind(event: OpEvent) -> str:
    kind = event.op_type.lower()
    if "send" in kind and event.is_transfer:
        return "send"
    if "recv" in kind and event.is_transfer:
        return "recv"
    return "op"


def op_columns(events: Iterable[OpEvent]) -> dict[str, list]:
    """Op events -> bar columns (milliseconds since the epoch; durations in microseconds)."""
    columns: dict[str, list] = {name: [] for name in OP_COLUMNS}
    for event in events:
        columns["row"].append(event.row)
        columns["left"].append(event.start * 1000.0)
        columns["right"].append(max(event.end, event.start) * 1000.0)
        columns["name"].append(event.name)
        columns["op_type"].append(event.op_type)
        columns["task"].append(event.task)
        columns["duration_us"].append(event.duration * 1e6)
        columns["kind"].append(op_kind(event))
    return columns


def link_columns(transfers: Iterable[tuple[OpEvent, OpEvent]]) -> dict[str, list]:
    """Send/Recv pairs -> segments from the send's start on its row to the recv's end on its row."""
    columns: dict[str, list] = {"x0": [], "y0": [], "x1": [], "y1": [], "key": [], "from": [], "to": []}
    for send, recv in transfers:
        columns["x0"].append(send.start * 1000.0)
        columns["y0"].append(send.row)
        columns["x1"].append(recv.end * 1000.0)
        columns["y1"].append(recv.row)
        columns["key"].append(send.transfer_key)
        columns["from"].append(send.task)
        columns["to"].append(recv.task)
    return columns


def profile_plot(rows: list[str], events: list[OpEvent], transfers: list[tuple[OpEvent, OpEvent]], title: str):
    """The timeline figure with one row per device/thread, ops as bars and transfers as links."""
    from ..compat import bokeh as bokeh_compat

    bokeh_compat.load()
    from bokeh.layouts import column
    from bokeh.models import ColumnDataSource, Div, HoverTool
    from bokeh.transform import factor_cmap

    from .timeline import timeline_figure

    plot = timeline_figure(rows, title=title, follow=False)
    plot.height = 90 + 22 * max(len(rows), 2)
    ops = ColumnDataSource(op_columns(events), name="profile_ops")
    bars = plot.hbar(y="row", left="left", right="right", height=0.7, source=ops,
                     color=factor_cmap("kind", KIND_COLOURS, KINDS), line_color=None)
    links = ColumnDataSource(link_columns(transfers), name="profile_transfers")
    segments = plot.segment(x0="x0", y0="y0", x1="x1", y1="y1", source=links, color="#d62728", line_width=1.5,
                            line_alpha=0.7)
    plot.add_tools(HoverTool(renderers=[bars], tooltips=[("op", "@name (@op_type)"), ("task", "@task"),
                                                          ("duration", "@duration_us{0.0} µs")]),
                   HoverTool(renderers=[segments], tooltips=[("transfer", "@from → @to"), ("key", "@key")]))
    legend = Div(text="<div class='workbench-profile-legend'><span style='color:#1f77b4'>■</span> op &nbsp; "
                      "<span style='color:#d62728'>■</span> Send &nbsp; <span style='color:#2ca02c'>■</span> Recv &nbsp; "
                      "<span style='color:#d62728'>—</span> a Send linked to its Recv</div>")
    return column(legend, plot, sizing_mode="stretch_width")
