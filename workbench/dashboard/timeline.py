"""The live timeline: one row per device of every task, each step drawn as its phases, task events as markers.

Zoomed out on more steps than it has pixels, it draws what they add up to (``overview_columns``); zoomed in,
every bar.
"""

from __future__ import annotations

import html
import math
import statistics
import time
from collections import deque

from ..telemetry.events import PHASES, StepSpan
from ..telemetry.log import EventLog
from .data import fault_columns, link_changes, new_rows, overview_columns, span_columns
from .plotting import EVENTS_PER_UPDATE, clock_axis, require_bokeh, stretch

# The kernel's log keeps the newest 100,000 events, and a timeline keeps as many bars, in segments
# of SEGMENT_ROWS: BokehJS re-indexes a source on every change, and one 100,000-row source made each
# update a ~0.4 s main-thread task (bench/dashboard.py); a 5,000-row segment is cheap to re-index.
TIMELINE_ROLLOVER = 100_000
SEGMENT_ROWS = 5_000
FOLLOW_MS = 30_000.0  # the timeline follows the newest 30 s until the user pans or zooms
PHASE_COLOURS = ("#1f77b4", "#ff7f0e", "#d62728", "#2ca02c", "#c7c7c7")  # PHASES order
FAULT_ROLLOVER = 2_000  # fault markers kept on a timeline
OVERVIEW_PIXELS = 3  # zoomed out, a bar of the overview every 3 pixels of every row
OVERVIEW_EVERY = 2.0  # seconds between redraws of the overview while it follows new bars
_NO_BARS = {"row": [], "left": [], "right": [], "phase": []}
DRAWN_WIDTH = 1000  # pixels a drawn timeline is taken to be wide (a notebook's or a pane's plot area, about)


def timeline_figure(rows: list[str], title: str = "Timeline", follow: bool = True):
    """An empty timeline: one categorical row per device, a datetime x axis that follows the newest data."""
    require_bokeh()
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


def _synced_range(plot) -> tuple[float, float] | None:
    """The x range a browser drew and sent back (start, end in ms), or None while none has."""
    start, end = plot.x_range.start, plot.x_range.end
    if isinstance(start, (int, float)) and isinstance(end, (int, float)) and not math.isnan(start) and end > start:
        return start, end
    return None


def _drawn_width(plot) -> int | None:
    """The plot's width in pixels, or None while no browser has drawn it. BokehJS keeps ``inner_width`` to itself,
    but a drawn plot sends its x range back: a drawn plot is taken to be ``DRAWN_WIDTH`` wide."""
    return DRAWN_WIDTH if _synced_range(plot) is not None else None


def _set_rows(plot, rows: list[str]) -> None:
    plot.y_range.factors = list(reversed(rows))
    plot.height = plot.min_height = 90 + 26 * max(len(rows), 2)


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
    Zoomed out on bars narrower than a pixel (a long job seen whole, a fast one followed), the segments are
    hidden and an overview stands for them: per row, a bar every ``OVERVIEW_PIXELS`` pixels in the phase that
    took most of it, as opaque as it was busy; zoomed in until bars are a pixel wide, every bar again.
    Panning back shows older segments (the range syncs back to the kernel). Whole segments roll out
    once more than ``rollover`` rows are kept; a stream touches only the newest segment.
    """

    def __init__(self, log: EventLog, rows: list[str], rollover: int | None = None, segment_rows: int | None = None,
                 follow: bool = True):
        require_bokeh()
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
        # zoomed out on more steps than pixels: what they add up to, a bar per row every few pixels
        self.overview_source = ColumnDataSource(overview_columns(_NO_BARS, 0.0, 0.0, 1.0), name="timeline_overview")
        self.overview = plot.hbar(y="row", left="left", right="right", height=0.7, source=self.overview_source,
                                  color=self._colour, fill_alpha="alpha", line_color=None, visible=False)
        plot.add_tools(HoverTool(renderers=[self.overview], tooltips=[
            ("row", "@row"), ("most of it", "@phase"), ("busy", "@busy_ms{0.0} ms"), ("bars", "@bars (zoom in for each)")]))
        self._overview_drawn: tuple = ()  # the view and bucket it was drawn for
        self._overview_at = 0.0
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

    def _view(self) -> tuple[float, float, bool]:
        """The time range in view (ms), and whether it follows the newest bars (its end then moves on)."""
        ends = [e for e in self.extents.values() if e[1] > -math.inf]
        newest = max((e[1] for e in ends), default=0.0)
        # not drawn yet: the range it will follow, or (a job's timeline) all of it
        start, end = _synced_range(self.plot) or (
            (newest - FOLLOW_MS, newest) if self.follow else (min((e[0] for e in ends), default=0.0), newest))
        return start, end, self.follow and end >= newest - 1000.0

    def _show_segments_in_view(self, start: float, end: float, following: bool, drawn: bool = True) -> None:
        """Draw only the segments whose time span overlaps the range in view (or, following, the newest); none
        while the overview stands for them (``drawn`` False)."""
        end = math.inf if following else end
        margin = (end - start) * 0.5 if end < math.inf else FOLLOW_MS * 0.5
        for source, renderer in self.segments:
            first, last = self.extents[id(source)]
            visible = drawn and (source is self.source or (last >= start - margin and first <= end + margin))
            if renderer.visible != visible:
                renderer.visible = visible

    def _typical_ms(self) -> float | None:
        """How long the newest bars last (ms): the median of the last 200."""
        durations = [d for source, _ in list(self.segments)[-2:] for d in source.data["duration_ms"][-200:]]
        return statistics.median(durations) if durations else None

    def _draw_view(self, now: float, streamed: bool) -> None:
        """Every bar where they are wider than a pixel; the overview where more steps than pixels are in view."""
        start, end, following = self._view()
        width = _drawn_width(self.plot)
        per_pixel = (end - start) / width if width else 0.0  # not drawn anywhere yet: no overview to compute
        typical = self._typical_ms()
        if typical is None or per_pixel <= typical:  # bars a pixel wide or more: each one
            if self.overview.visible:
                self.overview.visible = False
            self._show_segments_in_view(start, end, following)
            return
        self._show_segments_in_view(start, end, following, drawn=False)
        bucket = OVERVIEW_PIXELS * per_pixel
        view = (round(start / bucket), round(end / bucket), round(bucket, 3))
        changed = view != self._overview_drawn
        # the view moved with no new bar (the user panned or zoomed): at once; new bars: once a second at most
        if changed and (not streamed or not self.overview.visible or now - self._overview_at >= OVERVIEW_EVERY):
            self.overview_source.data = overview_columns(self._bars_between(start - bucket, end + bucket), start - bucket,
                                                         end + bucket, bucket)
            self._overview_drawn, self._overview_at = view, now
        if not self.overview.visible:
            self.overview.visible = True

    def _bars_between(self, start: float, end: float) -> dict[str, list]:
        """The completed bars of the segments that overlap ``start``..``end`` (ms): the overview's input."""
        joined: dict[str, list] = {name: [] for name in _NO_BARS}
        for source, _ in self.segments:
            first, last = self.extents[id(source)]
            if last >= start and first <= end:
                for name in joined:
                    joined[name].extend(source.data[name])
        return joined

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
        self._draw_view(now, bool(spans))
        if running or self.open_source.data["left"]:
            self.open_source.data = span_columns(running, now)
        self._update_legend({span.phase for span in [*spans, *running]})
        return len(spans)


__all__ = ["TimelineComponent", "phase_legend", "timeline_figure"]
