"""``wb.dashboard(cluster)``: the components in a notebook widget, kept live by a kernel thread."""

from __future__ import annotations

import html
import threading
import time
import weakref

from ..cluster import Cluster
from ..cluster.jobs import ENDED
from ..compat import jupyter_bokeh as bokeh_compat
from ..errors import ConfigurationError
from .components import DEFAULT_INTERVAL, PLOTS, make_components
from .data import device_rows
from .scope import JobView
from .server import default_cluster, serve_dashboard


class Dashboard:
    """Progress, throughput and the per-device timeline of a cluster's jobs, or of one job, live.

    In a notebook, display it (``wb.dashboard(cluster)`` or ``wb.dashboard(job)`` as the last line of a
    cell): a ``jupyter_bokeh`` widget with BokehJS inline (no CDN), updated every ``interval`` seconds
    from the cluster's telemetry by a kernel thread, also while another cell runs. A cluster's dashboard
    follows whatever runs (the newest 30 s of the timeline, 5 minutes of throughput); a job's spans that
    job from its start and stays on its final state once it ended. ``serve()`` gives the cluster's plots as
    Bokeh server apps (URLs for a browser tab or the JupyterLab panel).
    """

    def __init__(self, cluster, plots=tuple(PLOTS), interval: float = DEFAULT_INTERVAL, job=None):
        if not isinstance(interval, (int, float)) or isinstance(interval, bool) or not 0.05 <= interval <= 60:
            raise ConfigurationError(f"interval={interval!r}: pass seconds between updates, from 0.05 to 60.")
        self.cluster = cluster
        self.job = job  # the job it follows, or None: every job of the cluster
        self.interval = float(interval)
        self.rows = device_rows(cluster.tasks)
        self.view = JobView(cluster.telemetry, job.name) if job is not None else None
        source = self.view if self.view is not None else cluster.telemetry
        self.components = make_components(source, self.rows, tuple(plots), follow=job is None)
        self._widget = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._key = f"dashboard-widget-{id(self)}"  # under which the cluster keeps it while it updates
        self._drawn_after_end = False

    @property
    def layout(self):
        from bokeh.layouts import column

        if not hasattr(self, "_layout"):
            from bokeh.models import Div

            self._notice = Div(text="", name="dashboard_notice")  # says so when the live updates stop on an error
            self._layout = column(self._notice, *[c.root for c in self.components.values()], sizing_mode="stretch_width")
        return self._layout

    def stopped_by(self, exc: BaseException) -> str:
        """Show, above the plots, that live updates stopped on ``exc`` (a warning from a kernel thread may show
        nowhere); return the message."""
        message = f"the workbench dashboard stopped updating: {type(exc).__name__}: {exc}. Display it again to resume."
        try:
            if hasattr(self, "_notice"):
                with self._lock:
                    self._notice.text = f"<span style='color:#b00020'>{html.escape(message)}</span>"
        except Exception:  # noqa: BLE001 - the widget itself is gone (a closed comm): the warning is all there is
            pass
        return message

    @property
    def over(self) -> bool:
        """A job's dashboard whose job ended and whose last events are drawn: nothing will change any more."""
        return self.view is not None and self._drawn_after_end

    def update(self) -> None:
        """One update of every component (the live thread calls this every ``interval``).

        It is the last when the job's end was known as it began: each component then reads up to the end. (The
        end seen by a component during an update is not enough: one updated before it may have read less.)
        """
        now = time.time()
        ended = self.job is not None and (self.job.state in ENDED or self.view.over)
        with self._lock:
            for component in self.components.values():
                component.update(now)
        self._drawn_after_end = self._drawn_after_end or ended

    def widget(self):
        """The ``jupyter_bokeh.BokehModel`` widget (made once; BokehJS comes inline, not from a CDN)."""
        if self._widget is None:
            from .. import optional

            optional.require("jupyter_bokeh", "notebook dashboards")
            from bokeh.io import output_notebook
            from bokeh.resources import INLINE

            output_notebook(resources=INLINE, hide_banner=True)
            self.update()
            self._widget = bokeh_compat.live_widget_class(self._lock)(self.layout)
        return self._widget

    def start(self) -> Dashboard:
        """Keep the components live (idempotent) until ``stop_updates()``, ``close()``, the cluster stops or (a
        job's dashboard) the job ended."""
        if self.over:
            return self  # it shows the job's final state already
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            ref = weakref.ref(self)
            self._thread = threading.Thread(target=_live, args=(ref, self._stop, self.interval), daemon=True,
                                            name=f"workbench-dashboard-{self.cluster.name}")
            self._thread.start()
            # a displayed dashboard lives (and updates) as long as its cluster runs, then shows the final state
            self.cluster.keep(self._key, self, close=self.stop_updates)
        return self

    def stop_updates(self) -> None:
        """Stop the live updates after one last one (the widget keeps showing that state)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
            self.update()
        self.cluster.release(self._key)

    def close(self) -> None:
        """Stop updating and close the widget."""
        self.stop_updates()
        if self._widget is not None:
            self._widget.close()
            self._widget = None

    def serve(self, port: int = 0, **kwargs):
        """The cluster's Bokeh server apps (started once per cluster); see ``wb.serve_dashboard``."""
        return serve_dashboard(self.cluster, port=port, **kwargs)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())
        self.start()

    def __repr__(self) -> str:
        live = "live" if self._thread is not None and self._thread.is_alive() else "not live"
        of = f"job {self.job.name!r} on cluster" if self.job is not None else "cluster"
        return (f"<workbench.Dashboard of {of} {self.cluster.name!r} ({', '.join(self.components)}; {live}): display "
                "it in a notebook, or dashboard.serve() for URLs to open in a browser>")


def _live(ref, stop: threading.Event, interval: float) -> None:
    """The update loop; holds the dashboard weakly, so a dropped dashboard's thread ends. A job's dashboard
    stops after the update that drew its job's end: it stays on that final state."""
    while not stop.wait(interval):
        dashboard = ref()
        if dashboard is None:
            return
        try:
            dashboard.update()
            if dashboard.over:
                dashboard.cluster.release(dashboard._key)
                return
        except Exception as exc:  # noqa: BLE001 - a closed widget or comm: stop, and say why where it shows
            import warnings

            message = dashboard.stopped_by(exc)
            warnings.warn(message, stacklevel=1)
            return
        finally:
            del dashboard


def dashboard(target=None, *, plots=tuple(PLOTS), interval: float = DEFAULT_INTERVAL) -> Dashboard:
    """A live dashboard of a cluster or of one job (default: the last cluster started in this kernel).

    ``wb.dashboard(cluster)`` follows every job trained on the cluster (``wb.train(..., telemetry=True)``,
    the default), including jobs that ran before it was opened, as far as the telemetry log reaches: the
    newest 30 s of the timeline and 5 minutes of throughput. ``wb.dashboard(job)`` shows that job alone:
    its plots span the job from its start, and once it ended they stay on its final state (its average
    throughput, every step it ran), however many jobs come after. ``plots``: any of ``"progress"``,
    ``"throughput"``, ``"timeline"`` (all by default). Display the result in a notebook.
    """
    job = None
    if target is not None and not isinstance(target, Cluster):  # a job, which knows its cluster
        if not isinstance(getattr(target, "cluster", None), Cluster) or not isinstance(getattr(target, "name", None), str):
            raise ConfigurationError(f"wb.dashboard({target!r}): pass a wb.Cluster, or a job from wb.train.")
        job, target = target, target.cluster
    cluster = target if target is not None else default_cluster()
    if cluster.state != "running" and not cluster.telemetry.cursor:
        raise ConfigurationError(f"cluster {cluster.name!r} is {cluster.state} and recorded nothing: start it first.")
    return Dashboard(cluster, plots, interval, job=job)
