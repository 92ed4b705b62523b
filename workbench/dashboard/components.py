"""Live Bokeh components. One contract: ``root`` (the Bokeh model to lay out), ``sources`` (its
data), ``update()`` (read the events newer than the component's cursor and stream only those),
``fill()`` (take the height of a page of its own, as a served app does).

Each component belongs to one Bokeh document (a notebook widget or one browser session of a
served app); many components read the same ``EventLog``, each with its own cursor. The timeline is
in ``timeline.py``; throughput and progress are here, with the registry of plots.
"""

from __future__ import annotations

import html
import time

from ..cluster.jobs import RUNNING as RUNNING_JOB
from ..telemetry.events import JobProgress
from ..telemetry.log import EventLog
from .data import RATE_WINDOW, TOTAL, JobState, RecentRates, ThroughputBins, average_rates
from .plotting import DEFAULT_INTERVAL, EVENTS_PER_UPDATE, clock_axis, require_bokeh, stretch
from .summary import JobSummary
from .timeline import TimelineComponent

THROUGHPUT_ROLLOVER = 3_600  # one-second bins: the last hour
SERIES_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")


class ThroughputComponent:
    """Examples/s and steps/s per worker and in total, in one-second bins, and the current figures large."""

    def __init__(self, log: EventLog, bin_seconds: float = 1.0, follow: bool = True):
        require_bokeh()
        from bokeh.layouts import column, row
        from bokeh.models import ColumnDataSource, DataRange1d, Div, Legend
        from bokeh.plotting import figure

        self.log = log
        self.cursor = 0
        self.follow = follow
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
        if ended is not None and not self.follow and self.bins.bins:
            # a job's plot ends with its last counted bin, at once: its steps were all recorded before its end
            # was (a dashboard stops updating once it read the end, so bins left to settle would never be drawn),
            # and what came after them (its clean-up) trained nothing: no fall to zero
            now = (max(self.bins.bins) + 1) * self.bins.width + self.bins.settle
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
        require_bokeh()
        from bokeh.models import Div

        self.log = log
        self.summary = JobSummary(log, EVENTS_PER_UPDATE)
        self.root = Div(text=self._html(None), name="progress", sizing_mode="stretch_width")
        self.sources: list = []

    @property
    def info(self) -> dict | None:
        return self.summary.info

    def fill(self) -> None:
        """A line of text: it keeps its height on a page of its own."""

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
    from ..compat import bokeh as bokeh_compat
    from ..errors import ConfigurationError

    unknown = [n for n in names if n not in PLOTS]
    if unknown:
        raise ConfigurationError(f"no plot named {', '.join(map(repr, unknown))}: the plots are {', '.join(PLOTS)}.")
    bokeh_compat.load()  # not beside another thread's first import of Bokeh (the panel's served plots)
    return {name: PLOTS[name][1](log, rows, follow) for name in names}


__all__ = ["DEFAULT_INTERVAL", "PLOTS", "ProgressComponent", "ThroughputComponent", "make_components"]
