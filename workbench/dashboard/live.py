"""``wb.dashboard(cluster)``: the components in a notebook widget, kept live by a kernel thread."""

from __future__ import annotations

import html
import threading
import time
import weakref

from ..compat import jupyter_bokeh as bokeh_compat
from ..errors import ConfigurationError
from .components import DEFAULT_INTERVAL, PLOTS, make_components
from .data import device_rows
from .server import default_cluster, serve_dashboard


class Dashboard:
    """Progress, throughput and the per-device timeline of a cluster's jobs, live.

    In a notebook, display it (``wb.dashboard(cluster)`` as the last line of a cell): a
    ``jupyter_bokeh`` widget with BokehJS inline (no CDN), updated every ``interval`` seconds
    from the cluster's telemetry by a kernel thread, also while another cell runs. ``serve()``
    gives the same plots as Bokeh server apps (URLs for a browser tab or the JupyterLab panel).
    """

    def __init__(self, cluster, plots=tuple(PLOTS), interval: float = DEFAULT_INTERVAL):
        if not isinstance(interval, (int, float)) or isinstance(interval, bool) or not 0.05 <= interval <= 60:
            raise ConfigurationError(f"interval={interval!r}: pass seconds between updates, from 0.05 to 60.")
        self.cluster = cluster
        self.interval = float(interval)
        self.rows = device_rows(cluster.tasks)
        self.components = make_components(cluster.telemetry, self.rows, tuple(plots))
        self._widget = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._key = f"dashboard-widget-{id(self)}"  # under which the cluster keeps it while it updates

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

    def update(self) -> None:
        """One update of every component (the live thread calls this every ``interval``)."""
        now = time.time()
        with self._lock:
            for component in self.components.values():
                component.update(now)

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
        """Keep the components live (idempotent) until ``stop_updates()``, ``close()`` or the cluster stops."""
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
        return (f"<workbench.Dashboard of cluster {self.cluster.name!r} ({', '.join(self.components)}; {live}): display "
                "it in a notebook, or dashboard.serve() for URLs to open in a browser>")


def _live(ref, stop: threading.Event, interval: float) -> None:
    """The update loop; holds the dashboard weakly, so a dropped dashboard's thread ends."""
    while not stop.wait(interval):
        dashboard = ref()
        if dashboard is None:
            return
        try:
            dashboard.update()
        except Exception as exc:  # noqa: BLE001 - a closed widget or comm: stop, and say why where it shows
            import warnings

            message = dashboard.stopped_by(exc)
            warnings.warn(message, stacklevel=1)
            return
        finally:
            del dashboard


def dashboard(cluster=None, *, plots=tuple(PLOTS), interval: float = DEFAULT_INTERVAL) -> Dashboard:
    """A live dashboard of ``cluster`` (default: the last one started in this kernel).

    ``plots``: any of ``"progress"``, ``"throughput"``, ``"timeline"`` (all by default). Display the
    result in a notebook; it follows every job trained on the cluster (``wb.train(..., telemetry=True)``,
    the default), including jobs that ran before it was opened, as far as the telemetry log reaches.
    """
    cluster = cluster if cluster is not None else default_cluster()
    if cluster.state != "running" and not cluster.telemetry.cursor:
        raise ConfigurationError(f"cluster {cluster.name!r} is {cluster.state} and recorded nothing: start it first.")
    return Dashboard(cluster, plots, interval)
