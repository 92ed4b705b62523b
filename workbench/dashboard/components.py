"""Live Bokeh components. One contract: ``root`` (the Bokeh model to lay out), ``sources`` (its
data), ``update()`` (read the events newer than the component's cursor and stream only those).

Each component belongs to one Bokeh document (a notebook widget or one browser session of a
served app); many components read the same ``EventLog``, each with its own cursor.
"""

from __future__ import annotations

import html
import math
import time
from collections import deque

from ..cluster.jobs import RUNNING as RUNNING_JOB
from ..telemetry.events import PHASES, JobProgress, StepSpan
from ..telemetry.log import EventLog
from .data import (
    RATE_WINDOW,
    TOTAL,
    JobState,
    RecentRates,
    ThroughputBins,
    average_rates,
    fault_columns,
    link_changes,
    new_rows,
    row_name,
    span_columns,
)
from .summary import JobSummary

# The kernel's log keeps the newest 100,000 events, and a timeline keeps as many bars, in segments
# of SEGMENT_ROWS: BokehJS re-indexes a source on every change, and one 100,000-row source made each
# update a ~0.4 s main-thread task (bench/dashboard.py); a 5,000-row segment is cheap to re-index.
DEFAULT_INTERVAL = 0.25  # seconds between updates (widget and server apps): a step's bar appears within about this
TIMELINE_ROLLOVER = 100_000
SEGMENT_ROWS = 5_000
THROUGHPUT_ROLLOVER = 3_600  # one-second bins: the last hour
FOLLOW_MS = 30_000.0  # the timeline follows the newest 30 s until the user pans or zooms
EVENTS_PER_UPDATE = 20_000  # a long backlog is streamed over several updates, none of them long
PHASE_COLOURS = ("#1f77b4", "#ff7f0e", "#d62728", "#2ca02c", "#c7c7c7")  # PHASES order
SERIES_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")


FAULT_ROLLOVER = 2_000  # fault markers kept on a timeline


def _bokeh():
    from .. import optional

    return optional.require("bokeh", "the dashboards")


def timeline_figure(rows: list[str], title: str = "Timeline", follow: bool = True):
    """An empty timeline: one categorical row per device, a datetime x axis that follows the newest data."""
    _bokeh()
    from bokeh.models import DataRange1d, FactorRange
    from bokeh.plotting import figure

    x_range = DataRange1d(follow="end", follow_interval=FOLLOW_MS, range_padding=0.02) if follow else DataRange1d()
    plot = figure(title=title, y_range=FactorRange(*reversed(rows)), x_range=x_range, x_axis_type="datetime",
                  height=90 + 26 * max(len(rows), 2), sizing_mode="stretch_width",
                  tools="xpan,xwheel_zoom,box_zoom,reset,save", active_scroll="xwheel_zoom", name="timeline")
    plot.yaxis.major_label_text_font_size = "9pt"
    plot.ygrid.grid_line_color = None
    plot.xaxis.axis_label = "time (kernel clock)"
    clock_axis(plot)
    return plot


def clock_axis(plot) -> None:
    """Time of day on the x axis at every zoom (Bokeh's default labels a short span "0ms 200ms ... 0ms")."""
    from bokeh.models import DatetimeTickFormatter

    plot.xaxis.formatter = DatetimeTickFormatter(
        microseconds="%H:%M:%S.%3N", milliseconds="%H:%M:%S.%3N", seconds="%H:%M:%S", minsec="%H:%M:%S",
        minutes="%H:%M", hourmin="%H:%M", hours="%H:%M", context=None)
    plot.xaxis.ticker.desired_num_ticks = 5  # a label is 8 to 12 characters wide: fewer, and none overlap


def _set_rows(plot, rows: list[str]) -> None:
    plot.y_range.factors = list(reversed(rows))
    plot.height = plot.min_height = 90 + 26 * max(len(rows), 2)


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


PHASE_MEANINGS = {
    "compute": "forward and backward pass", "push+apply": "gradients to the ps, applied, parameters back",
    "allreduce+apply": "gradients summed across workers, applied", "apply": "averaged gradients applied on the ps",
    "running": "a call still running (hatched)",
}
# what the diamonds on a task's row mean, by colour (data.FAULT_COLOURS)
MARKER_MEANINGS = (("#d62728", "lost or failed"), ("#ff9f1c", "silent, straggling or dropped"),
                   ("#9467bd", "being re-hosted"), ("#2ca02c", "back or recovered"))


def _swatch(colour: str, label: str, title: str = "", diamond: bool = False) -> str:
    shape = ("width:9px;height:9px;transform:rotate(45deg);margin:0 2px" if diamond else "width:12px;height:12px")
    return (f"<span style='white-space:nowrap;margin-right:10px' title='{html.escape(title)}'><span style='display:"
            f"inline-block;{shape};background:{colour};vertical-align:middle'></span> {html.escape(label)}</span>")


def phase_legend(phases=PHASES, markers: bool = False, links: bool = False) -> str:
    """The legend of the timeline as HTML: the colours of the phases shown, and (once there are some) what the
    diamonds on a task's row and the shaded bands mean. Hover over an entry for what it measures."""
    colours = dict(zip(PHASES, PHASE_COLOURS))
    parts = [_swatch(colours[p], p, PHASE_MEANINGS.get(p, "")) for p in PHASES if p in phases]
    if markers:
        parts.append("<span style='white-space:nowrap;margin-right:4px'>task events:</span>" + "".join(
            _swatch(colour, meaning, diamond=True) for colour, meaning in MARKER_MEANINGS))
    if links:
        parts.append(_swatch("rgba(31,119,180,0.15)", "links shaped (cluster.shape)"))
    return "<div class='workbench-phases'>" + " ".join(parts) + "</div>"


class TimelineComponent:
    """Step spans of every device, completed and in progress (which grow until they end).

    Completed bars go into segments of ``segment_rows`` rows, each its own data source and
    renderer. BokehJS maps every bar of every visible renderer to the screen whenever the range
    moves (each update, while it follows the newest data), so a segment is drawn only while its time
    span overlaps the range in view: with 100,000 bars kept, an update maps the few thousand in view.
    Panning back shows older segments (the range syncs back to the kernel). Whole segments roll out
    once more than ``rollover`` rows are kept; a stream touches only the newest segment.
    """

    def __init__(self, log: EventLog, rows: list[str], rollover: int | None = None, segment_rows: int | None = None,
                 follow: bool = True):
        _bokeh()
        from bokeh.layouts import column
        from bokeh.models import ColumnDataSource, Div, HoverTool
        from bokeh.transform import factor_cmap

        self.log, self.rows, self.follow = log, list(rows), follow
        self.phases: set[str] = set()  # the phases drawn so far: the legend lists those
        self.legend = Div(text=phase_legend(()), name="timeline_legend", sizing_mode="stretch_width")
        self.rollover = TIMELINE_ROLLOVER if rollover is None else int(rollover)
        self.segment_rows = max(1, min(int(segment_rows or SEGMENT_ROWS), self.rollover))
        self.cursor = 0  # show what the log still holds: a dashboard opened after a job shows the job
        self.missed = 0
        self._colour = factor_cmap("phase", PHASE_COLOURS, PHASES)
        self.segments: deque = deque()  # (source, renderer), oldest first
        self.extents: dict[int, list[float]] = {}  # id(source) -> [first left, last right] in ms
        self._segment_number = 0
        self.open_source = ColumnDataSource(span_columns([]), name="timeline_in_progress")
        self.plot = plot = timeline_figure(self.rows, follow=follow)
        plot.hbar(y="row", left="left", right="right", height=0.7, source=self.open_source, color=self._colour,
                  fill_alpha=0.45, hatch_pattern="/", hatch_alpha=0.5, line_color="#555555")
        self._span_hover = HoverTool(renderers=[plot.renderers[-1]], tooltips=[  # segments join it as they are made
            ("task", "@task"), ("phase", "@phase"), ("step", "@step (x@steps)"), ("duration", "@duration_ms{0.0} ms"),
            ("examples", "@examples"), ("job", "@job")])
        plot.add_tools(self._span_hover)
        # task health and what jobs did about it: lost, silent, straggling, recovering, back
        self.fault_source = ColumnDataSource(fault_columns([], self.rows), name="timeline_faults")
        faults = plot.scatter(x="x", y="row", source=self.fault_source, marker="diamond", size=13, color="colour",
                              line_color="#222222")
        plot.add_tools(HoverTool(renderers=[faults], tooltips=[("task", "@task"), ("", "@kind"), ("why", "@detail"),
                                                                ("job", "@job"), ("at", "@x{%H:%M:%S}")],
                                 formatters={"@x": "datetime"}))
        self.link_bands: list = []  # shaded while the links were shaped (cluster.shape), newest last
        self._new_segment()
        self.root = column(self.legend, plot, sizing_mode="stretch_width")

    def fill(self) -> None:
        """Fill the height of the page (a served app, a pane of the panel), not only its width."""
        stretch(self.root, [self.plot])

    def _update_legend(self, phases: set[str]) -> None:
        if phases <= self.phases and not (self.fault_source.data["x"] and "markers" not in self.phases) \
                and not (self.link_bands and "links" not in self.phases):
            return
        self.phases |= phases
        if self.fault_source.data["x"]:
            self.phases.add("markers")
        if self.link_bands:
            self.phases.add("links")
        self.legend.text = phase_legend(self.phases, "markers" in self.phases, "links" in self.phases)

    def _shade_links(self, at: float, shaping: str) -> None:
        """A band from ``at`` (ms) while the links are shaped; the previous band ends there."""
        from bokeh.models import BoxAnnotation, Label

        if self.link_bands:
            self.link_bands[-1].right = at
        if shaping == "unshaped":
            return
        band = BoxAnnotation(left=at, fill_color="#1f77b4", fill_alpha=0.08, line_color="#1f77b4", line_alpha=0.4,
                             name="timeline_links")
        self.plot.add_layout(band)
        self.plot.add_layout(Label(x=at, y=4, y_units="screen", text=f"links: {shaping}", text_font_size="9pt",
                                   text_color="#1f4e79", name="timeline_links_label"))
        self.link_bands.append(band)

    @property
    def sources(self) -> list:
        return [s for s, _ in self.segments] + [self.open_source]

    @property
    def source(self):
        """The newest segment's data source."""
        return self.segments[-1][0]

    def columns(self) -> dict[str, list]:
        """Every completed bar the timeline holds, oldest first (all segments joined)."""
        joined: dict[str, list] = {name: [] for name in self.source.data}
        for source, _ in self.segments:
            for name, values in source.data.items():
                joined[name].extend(values)
        return joined

    def _new_segment(self) -> None:
        from bokeh.models import ColumnDataSource

        self._segment_number += 1
        source = ColumnDataSource(span_columns([]), name=f"timeline_steps_{self._segment_number}")
        renderer = self.plot.hbar(y="row", left="left", right="right", height=0.7, source=source, color=self._colour,
                                  line_color=None)
        self._span_hover.renderers = [*self._span_hover.renderers, renderer]
        self.segments.append((source, renderer))
        self.extents[id(source)] = [math.inf, -math.inf]
        full = len(self.segments) - 1
        if full * self.segment_rows > self.rollover:  # whole segments roll out, oldest first
            gone, old = self.segments.popleft()
            del self.extents[id(gone)]
            self.plot.renderers = [r for r in self.plot.renderers if r is not old]
            self._span_hover.renderers = [r for r in self._span_hover.renderers if r is not old]

    def _stream(self, columns: dict[str, list]) -> None:
        done, total = 0, len(columns["left"])
        while done < total:
            room = self.segment_rows - len(self.source.data["left"])
            if room <= 0:
                self._new_segment()
                continue
            part = {name: values[done:done + room] for name, values in columns.items()}
            extent = self.extents[id(self.source)]
            extent[0], extent[1] = min(extent[0], min(part["left"])), max(extent[1], max(part["right"]))
            self.source.stream(part)
            done += room

    def _show_segments_in_view(self) -> None:
        """Draw only the segments whose time span overlaps the range in view (or, following, the newest)."""
        x_range = self.plot.x_range
        newest = max((e[1] for e in self.extents.values() if e[1] > -math.inf), default=None)
        start, end = x_range.start, x_range.end
        if not isinstance(start, (int, float)) or not isinstance(end, (int, float)) or math.isnan(start) or math.isnan(end):
            # not drawn yet: the range it will follow, or (a job's timeline) all of it
            start, end = ((newest or 0.0) - FOLLOW_MS, math.inf) if self.follow else (-math.inf, math.inf)
        if self.follow and newest is not None and end >= newest - 1000.0:  # following the newest data: it moves on
            end = math.inf
        margin = (end - start) * 0.5 if end < math.inf and start > -math.inf else FOLLOW_MS * 0.5
        for source, renderer in self.segments:
            first, last = self.extents[id(source)]
            visible = source is self.source or (last >= start - margin and first <= end + margin)
            if renderer.visible != visible:
                renderer.visible = visible

    def update(self, now: float | None = None) -> int:
        """Stream new completed spans, redraw the in-progress ones; return how many rows were streamed."""
        now = time.time() if now is None else now
        behind = self.log.cursor - self.cursor
        if behind > self.rollover + self.segment_rows:  # what would roll straight out again is not sent at all
            self.cursor += behind - self.rollover
        batch = self.log.since(self.cursor, EVENTS_PER_UPDATE)
        self.cursor, self.missed = batch.cursor, self.missed + batch.missed
        spans = [e for e in batch.events if isinstance(e, StepSpan) and e.end is not None]
        running = self.log.in_progress()
        extra = new_rows([*spans, *running], self.rows)
        if extra:
            self.rows.extend(extra)
            _set_rows(self.plot, self.rows)
        if spans:
            self._stream(span_columns(spans))
        faults = fault_columns(batch.events, self.rows)
        if faults["x"]:
            self.fault_source.stream(faults, rollover=FAULT_ROLLOVER)
        for at, shaping in link_changes(batch.events):
            self._shade_links(at, shaping)
        self._show_segments_in_view()
        if running or self.open_source.data["left"]:
            self.open_source.data = span_columns(running, now)
        self._update_legend({span.phase for span in [*spans, *running]})
        return len(spans)


class ThroughputComponent:
    """Examples/s and steps/s per worker and in total, in one-second bins, and the current figures large."""

    def __init__(self, log: EventLog, bin_seconds: float = 1.0, follow: bool = True):
        _bokeh()
        from bokeh.layouts import column, row
        from bokeh.models import ColumnDataSource, DataRange1d, Div, Legend
        from bokeh.plotting import figure

        self.log = log
        self.cursor = 0
        self.bins = ThroughputBins(width=bin_seconds)
        self.rates = RecentRates()
        self.latest: JobState | None = None  # the newest job: an ended one's figures are its averages
        self.source = ColumnDataSource(self._empty(), name="throughput")
        self.sources = [self.source]
        self.figure_div = Div(text=self._big(None), name="throughput_now")
        # the last 5 minutes, following; or (a job's dashboard) the whole job
        # (at least 10 s wide: a short job's few one-second points spread over a readable axis)
        shared_x = DataRange1d(follow="end", follow_interval=300_000.0, range_padding=0.02) if follow else DataRange1d(
            range_padding=0.05, min_interval=10_000.0)
        self.examples_plot, self.steps_plot = (
            figure(title=title, x_axis_type="datetime", x_range=shared_x, height=230, sizing_mode="stretch_width",
                   tools="xpan,xwheel_zoom,reset,save", y_axis_label=title, x_axis_label="time (kernel clock)",
                   name=f"throughput_{kind}") for title, kind in (("examples/s", "examples"), ("steps/s", "steps")))
        for plot in (self.examples_plot, self.steps_plot):
            clock_axis(plot)
            plot.y_range.start = 0
            # below the plot, not on the lines; a click on an entry hides its series
            plot.add_layout(Legend(orientation="horizontal", click_policy="hide", label_text_font_size="8pt",
                                   spacing=4, padding=2, margin=2, border_line_alpha=0), "below")
        self.lines: dict[str, list] = {}
        self._add_lines(TOTAL)
        self.root = column(self.figure_div, row(self.examples_plot, self.steps_plot, sizing_mode="stretch_width"),
                           sizing_mode="stretch_width")

    def _empty(self) -> dict[str, list]:
        return {"time": [], **{f"{s}:{k}": [] for s in self.bins.series for k in ("examples", "steps")}}

    def _add_lines(self, series: str) -> None:
        colour = "black" if series == TOTAL else SERIES_COLOURS[(len(self.lines) - 1) % len(SERIES_COLOURS)]
        width = 3 if series == TOTAL else 1.5
        self.lines[series] = [  # with markers: a short job's few one-second points still show as points
            renderer
            for plot, kind in ((self.examples_plot, "examples"), (self.steps_plot, "steps"))
            for renderer in (plot.line("time", f"{series}:{kind}", source=self.source, color=colour, line_width=width,
                                       legend_label=series),
                             plot.scatter("time", f"{series}:{kind}", source=self.source, color=colour, size=4,
                                          legend_label=series))
        ]

    def fill(self) -> None:
        """Fill the height of the page (a served app, a pane of the panel), not only its width."""
        stretch(self.root, [self.examples_plot, self.steps_plot])

    @staticmethod
    def _big(rates: dict | None, ended: JobState | None = None) -> str:
        """The figures now (the last ``RATE_WINDOW`` s); once the newest job ended, its averages instead."""
        if ended is not None:
            average = average_rates(ended)
            examples, steps = average["average_examples_per_s"], average["average_steps_per_s"]
            when = f"job {html.escape(ended.job)} {html.escape(ended.state)}: its average"
            rates = {}
        else:
            examples, steps = (rates or {}).get(TOTAL, (0.0, 0.0))
            when = f"last {RATE_WINDOW:.0f} s"
        parts = [f"<span style='font-size:28px;font-weight:600'>{examples:,.0f}</span> examples/s &nbsp; "
                 f"<span style='font-size:28px;font-weight:600'>{steps:,.1f}</span> steps/s"]
        workers = sorted(k for k in (rates or {}) if k != TOTAL)
        if workers:
            parts.append("<br><span style='color:#555'>" + " · ".join(
                f"{html.escape(w)}: {rates[w][0]:,.0f} ex/s, {rates[w][1]:,.1f} steps/s" for w in workers) + "</span>")
        return f"<div class='workbench-throughput-now'>{''.join(parts)} <span style='color:#888'>({when})</span></div>"

    def _follow_jobs(self, events: list) -> None:
        for event in events:
            name = getattr(event, "job", "")
            if isinstance(event, JobProgress) and event.state == RUNNING_JOB and (
                    self.latest is None or self.latest.job != name):
                self.latest = JobState(name)
            if self.latest is not None and name == self.latest.job:
                self.latest.add(event)

    def update(self, now: float | None = None) -> int:
        now = time.time() if now is None else now
        batch = self.log.since(self.cursor, EVENTS_PER_UPDATE)
        self.cursor = batch.cursor
        known = list(self.bins.series)
        self.bins.add(batch.events)
        self.rates.add(batch.events)
        self._follow_jobs(batch.events)
        rates = self.rates.rates(now)
        ended = self.latest if self.latest is not None and self.latest.ended else None
        self.figure_div.text = self._big(rates, ended)
        if self.bins.series != known:  # a new worker: every row gets its columns (zeros before it appeared)
            emitted = self.bins.emitted
            data = self._empty()
            if emitted is not None and self.source.data["time"]:
                first = int(round(self.source.data["time"][0] / 1000.0 / self.bins.width))
                for row in (self.bins.row(i) for i in range(first, emitted + 1)):
                    for name, value in row.items():
                        data[name].append(value)
            self.source.data = data
            for series in self.bins.series:
                if series not in self.lines:
                    self._add_lines(series)
        rows = self.bins.final(now)
        self._patch_late(self.bins.take_changed())
        if rows:
            self.source.stream({name: [r[name] for r in rows] for name in rows[0]}, rollover=THROUGHPUT_ROLLOVER)
        return len(rows)

    def _patch_late(self, changed: list[int]) -> None:
        """Results that came after their bin was drawn (a long call) update that bin in place."""
        times = self.source.data["time"]
        if not changed or not times:
            return
        first = int(round(times[0] / 1000.0 / self.bins.width))
        patches: dict[str, list] = {}
        for index in changed:
            position = index - first
            if 0 <= position < len(times):
                for name, value in self.bins.row(index).items():
                    if name != "time":
                        patches.setdefault(name, []).append((position, value))
        if patches:
            self.source.patch(patches)


class ProgressComponent:
    """The newest job: steps done / total, ETA, and notes on stale workers and slow steps."""

    def __init__(self, log: EventLog):
        _bokeh()
        from bokeh.models import Div

        self.log = log
        self.summary = JobSummary(log, EVENTS_PER_UPDATE)
        self.root = Div(text=self._html(None), name="progress", sizing_mode="stretch_width")
        self.sources: list = []

    @property
    def info(self) -> dict | None:
        return self.summary.info

    def update(self, now: float | None = None) -> int:
        before = self.summary.cursor
        info = self.summary.update(now)
        if info is not None:
            self.root.text = self._html(info)
        return self.summary.cursor - before

    @staticmethod
    def _html(info: dict | None) -> str:
        if info is None:
            return "<div class='workbench-progress'>No job yet: start one with <code>wb.train(cluster, ...)</code>.</div>"
        eta = "" if info["eta_s"] is None else f" · ETA {info['eta_s']:.0f} s"
        bar = (f"<div style='background:#eee;width:100%;height:8px'><div style='background:#1f77b4;height:8px;"
               f"width:{100 * min(info['fraction'], 1):.1f}%'></div></div>")
        notes = "".join(f"<div style='color:#b35900'>⚠ {html.escape(n)}</div>" for n in info["notes"])
        notes += "".join(f"<div class='workbench-running'>also running: {html.escape(r)}</div>" for r in info.get("running", ()))
        notes += "".join(f"<div class='workbench-queued'>queued: {html.escape(q)}</div>" for q in info.get("queued", ()))
        moved = (f" · <span class='workbench-bytes'>{info['bytes_per_step'] / 1e3:,.1f} kB/step "
                 f"({html.escape(info['transfer'])})</span>" if info.get("bytes_per_step") else "")
        return (f"<div class='workbench-progress'><b>{html.escape(info['job'])}</b> ({html.escape(info['strategy'])}, "
                f"{html.escape(info['state'])}): <span class='workbench-steps'>{info['steps_done']} / {info['steps_total']}"
                f"</span> steps{eta} · {info['elapsed_s']:.0f} s elapsed{moved}{bar}{notes}</div>")


PLOTS = {
    "progress": ("Job progress", lambda log, rows, follow: ProgressComponent(log)),
    "throughput": ("Throughput", lambda log, rows, follow: ThroughputComponent(log, follow=follow)),
    "timeline": ("Timeline", lambda log, rows, follow: TimelineComponent(log, rows, follow=follow)),
}


def make_components(log: EventLog, rows: list[str], names=tuple(PLOTS), follow: bool = True) -> dict:
    """Fresh components (for one Bokeh document) by plot name; unknown names raise a clear error.

    ``follow``: the plots follow the newest data (a cluster's dashboard); ``False`` spans all the log holds
    (a job's dashboard, reading a ``JobView``).
    """
    from ..errors import ConfigurationError

    unknown = [n for n in names if n not in PLOTS]
    if unknown:
        raise ConfigurationError(f"no plot named {', '.join(map(repr, unknown))}: the plots are {', '.join(PLOTS)}.")
    return {name: PLOTS[name][1](log, rows, follow) for name in names}


__all__ = ["PLOTS", "ProgressComponent", "ThroughputComponent", "TimelineComponent", "make_components",
           "row_name", "timeline_figure"]
