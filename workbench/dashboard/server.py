"""The same components as Bokeh server apps: one route per plot, plus a JSON list of the plots.

The server runs in the kernel (it reads the cluster's telemetry log directly), on its own thread
and event loop, bound to 127.0.0.1 only. ``GET <prefix>/plots.json`` lists the plots; the
JupyterLab panel renders buttons from that list and opens each route in a frame.
``GET <prefix>/summary.json`` is the newest job in numbers.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from ..cluster.registry import Endpoint
from ..compat import bokeh as bokeh_compat
from ..errors import ConfigurationError, WorkbenchError
from ..serving import ServingThread, local_host
from .components import DEFAULT_INTERVAL, PLOTS, make_components
from .data import device_rows
from .summary import JobSummary

START_TIMEOUT = 30.0
PAGE_ROOT = "workbench_page"  # the root of each served plot's document; JupyterLab's pane tags it while hidden
HIDDEN = "hidden"
SERVED_KEY = "dashboard-server"  # the cluster keeps its one served dashboard under this key


@dataclass(frozen=True)
class PlotEntry:
    """One served plot, as ``plots.json`` lists it (the JupyterLab panel reads exactly this)."""

    name: str
    title: str
    path: str  # relative to the server's root: prefix + "/" + name
    url: str


class DashboardServerError(WorkbenchError):
    """The dashboard server could not start or answer."""


class DashboardServer:
    """Bokeh apps ``/progress``, ``/throughput``, ``/timeline`` and ``/dashboard`` (all three) of one cluster.

    Also ``/profile`` (the cluster's latest op-level profile), ``GET /plots.json`` (the list of plots) and
    ``GET /summary.json`` (the newest job's progress, ETA, notes and throughput now). A page whose root (named
    ``PAGE_ROOT``) is tagged ``HIDDEN`` is not updated until the tag goes: JupyterLab's pane tags it while another
    tab covers it, since BokehJS draws a hidden page as busily as a shown one.
    """

    def __init__(self, cluster, port: int = 0, prefix: str = "", allow_websocket_origin: list[str] | None = None,
                 interval: float = DEFAULT_INTERVAL):
        if prefix and (not prefix.startswith("/") or prefix.endswith("/")):
            raise ConfigurationError(f"prefix={prefix!r}: pass '' or a path like '/proxy/absolute/5006'.")
        self.cluster, self.port, self.prefix, self.interval = cluster, int(port), prefix, float(interval)
        self._origins = list(allow_websocket_origin or [])
        self._serving = ServingThread(f"workbench-bokeh-{cluster.name}")
        self.sessions_opened = 0
        self._summary = JobSummary(cluster.telemetry)  # read only in the server's thread

    # -- apps ---------------------------------------------------------------------------------

    def _app(self, names: tuple[str, ...]):
        from bokeh.application import Application
        from bokeh.application.handlers.function import FunctionHandler
        from bokeh.layouts import column

        def make_document(doc) -> None:
            components = make_components(self.cluster.telemetry, device_rows(self.cluster.tasks), names)
            for component in components.values():
                component.update()
                component.fill()  # a page of its own: the plots take its height too
            page = column(*[c.root for c in components.values()], sizing_mode="stretch_both", name=PAGE_ROOT)
            doc.add_root(page)
            doc.title = f"workbench · {self.cluster.name} · {', '.join(names)}"

            def update() -> None:
                if HIDDEN in page.tags:  # a pane behind another tab: no drawing; it catches up when shown
                    return
                for component in components.values():
                    component.update()

            doc.add_periodic_callback(update, int(self.interval * 1000))
            self.sessions_opened += 1

        return Application(FunctionHandler(make_document))

    def _profile_app(self):
        """The cluster's latest op-level profile (``cluster.profile()``), replaced when a newer one is taken."""
        from bokeh.application import Application
        from bokeh.application.handlers.function import FunctionHandler
        from bokeh.models import Div

        def make_document(doc) -> None:
            shown = {"profile": None}

            def refresh() -> None:
                profile = self.cluster.last_profile
                if profile is shown["profile"] and doc.roots:
                    return
                shown["profile"] = profile
                doc.clear()
                doc.add_root(profile.plot() if profile is not None else Div(
                    text="<div class='workbench-no-profile'>No profile yet: take one with "
                         "<code>cluster.profile(seconds=2)</code> or <code>%wb profile 2</code>.</div>"))

            refresh()
            doc.title = f"workbench · {self.cluster.name} · profile"
            doc.add_periodic_callback(refresh, 1000)

        return Application(FunctionHandler(make_document))

    @property
    def thread_id(self) -> int | None:
        """The operating-system id of the thread that serves the apps (for measuring its CPU), or None."""
        return self._serving.native_id

    def plots(self) -> list[PlotEntry]:
        names = [*PLOTS, "dashboard", "profile"]
        titles = {**{k: v[0] for k, v in PLOTS.items()}, "dashboard": "All plots", "profile": "Latest op-level profile"}
        return [PlotEntry(n, titles[n], f"{self.prefix}/{n}", f"{self.url}/{n}") for n in names]

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> DashboardServer:
        if self._serving.running:
            return self
        try:
            self._serving.start(self._serve, START_TIMEOUT)
        except TimeoutError:
            raise DashboardServerError(f"the dashboard server did not start within {START_TIMEOUT:.0f} s.") from None
        except Exception as exc:  # noqa: BLE001 - Bokeh and tornado raise many kinds; the message says what to do
            raise DashboardServerError(f"the dashboard server could not start on port {self.port}: {exc}. "
                                       "Pass another port, or port=0 for a free one.") from None
        return self

    def _serve(self):
        bokeh_compat.load(server=True)  # not beside the notebook's first import of Bokeh
        from bokeh.server.server import Server
        from tornado.web import HTTPError, RequestHandler

        owner = self

        class LocalOnly(RequestHandler):
            def prepare(self) -> None:
                if not local_host(self.request.headers.get("Host"), owner.port):
                    raise HTTPError(403, "addressed to another host than 127.0.0.1")

        class PlotsHandler(LocalOnly):
            def get(self) -> None:
                self.set_header("Content-Type", "application/json")
                self.write(json.dumps({"cluster": owner.cluster.name, "plots": [asdict(p) for p in owner.plots()]}))

        class SummaryHandler(LocalOnly):  # the newest job's progress and throughput now
            def get(self) -> None:
                self.set_header("Content-Type", "application/json")
                self.write(json.dumps({"cluster": owner.cluster.name, "job": owner._summary.update()}))

        apps = {f"/{name}": self._app((name,)) for name in PLOTS}
        apps["/dashboard"] = self._app(tuple(PLOTS))
        apps["/profile"] = self._profile_app()
        self._server = Server(apps, port=self.port, address="127.0.0.1", prefix=self.prefix,
                              allow_websocket_origin=[f"127.0.0.1:{self.port}", f"localhost:{self.port}", *self._origins]
                              if self.port else None,
                              extra_patterns=[(f"{self.prefix}/plots.json", PlotsHandler),
                                              (f"{self.prefix}/summary.json", SummaryHandler)])
        self._server.start()
        self.port = self._server.port
        if not self._origins:  # port 0 chose a port: allow pages from it
            bokeh_compat.allow_websocket_origins(self._server, {f"127.0.0.1:{self.port}", f"localhost:{self.port}"})
        return self._server.stop

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.prefix}"

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and end the server's thread."""
        self._serving.stop(timeout)

    def __repr__(self) -> str:
        return f"<workbench.DashboardServer {self.url}: {', '.join(p.name for p in self.plots())}>"

    def _repr_html_(self) -> str:
        links = " · ".join(f"<a href='{p.url}' target='_blank'>{p.title}</a>" for p in self.plots())
        return f"<div>Dashboard of <b>{self.cluster.name}</b>: {links} (<a href='{self.url}/plots.json'>plots.json</a>)</div>"


def default_cluster():
    """The newest cluster running in this process: what ``wb.dashboard()`` and ``wb.serve_dashboard()`` show."""
    from ..cluster.cluster import running_clusters

    clusters = running_clusters()
    if not clusters:
        raise ConfigurationError("no cluster is running in this kernel: start one (wb.Cluster(...).start()) and pass it.")
    return clusters[-1]


def serve_dashboard(cluster=None, port: int = 0, prefix: str = "", **kwargs) -> DashboardServer:
    """Serve ``cluster``'s dashboards as Bokeh apps on 127.0.0.1 (once per cluster; stopped with it)."""
    cluster = cluster if cluster is not None else default_cluster()
    existing = cluster.kept(SERVED_KEY)
    if existing is not None:
        return existing
    server = DashboardServer(cluster, port=port, prefix=prefix, **kwargs).start()
    cluster.keep(SERVED_KEY, server, close=server.stop)
    cluster.advertise("dashboard", Endpoint(server.url))  # the registry record lists it for other processes
    return server
