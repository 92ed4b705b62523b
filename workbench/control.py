"""The owner's control endpoint: how other processes (the Jupyter server's panel) act on a cluster.

Every cluster this process starts serves a few token-protected routes on 127.0.0.1, on its own
thread, and advertises their URL and token in its registry record (a file only this user can read)
as the endpoint ``"control"``. It lives above both the engine pool and the dashboards, which it
uses; importing this module adds ``start_control_endpoint`` to ``Cluster.start_hooks``.

- ``GET  /summary``     the newest job's progress and throughput now (``JobSummary``);
- ``POST /scale``       ``{"workers": n}``: ``cluster.scale(workers=n)``;
- ``POST /stop``        ``cluster.stop()``, answered at once (202): the record disappears when done;
- ``POST /dashboards``  ``{"prefix": "/..."}``: serve the Bokeh apps under that path prefix (for the
  Jupyter server's authenticated proxy) and answer their URL.

Operations run one at a time on a worker thread, never on the kernel's main thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import secrets
import threading
from typing import Any

from .cluster.cluster import Cluster
from .cluster.registry import Endpoint
from .dashboard.server import DashboardServer
from .dashboard.summary import JobSummary
from .errors import ConfigurationError, WorkbenchError
from .optional import require
from .serving import ServingThread, local_host
from .telemetry.wire import decode

START_TIMEOUT = 10.0


class ControlServer:
    """Token-protected routes on 127.0.0.1 that act on one cluster (see the module docstring)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.token = secrets.token_urlsafe(24)
        self.port = 0
        self._serving = ServingThread(f"workbench-control-{cluster.name}")
        self._work = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"workbench-control-{cluster.name}")
        self._dashboards: dict[str, Any] = {}  # prefix -> DashboardServer, for the Jupyter server's proxy
        self._summary = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def endpoint(self) -> Endpoint:
        """What the registry record holds so that the Jupyter server can reach this endpoint."""
        return Endpoint(self.url, self.token)

    # -- operations (on the worker thread) --------------------------------------------------

    def summary(self) -> dict | None:
        if self._summary is None:
            self._summary = JobSummary(self.cluster.telemetry)
        return self._summary.update()

    def telemetry(self, body: dict) -> dict:
        """Job events of an attached process (``telemetry/forwarding.py``): into this cluster's telemetry log."""
        try:
            events = decode(body.get("events"))
        except ValueError as exc:
            raise ConfigurationError(f"telemetry: {exc}") from None
        self.cluster.telemetry.extend(events)
        return {"accepted": len(events)}

    def scale(self, body: dict) -> dict:
        workers = body.get("workers")
        if not isinstance(workers, int) or isinstance(workers, bool):
            raise ConfigurationError(f"workers={workers!r}: send the new number of worker tasks as an integer >= 1.")
        self.cluster.scale(workers=workers)
        return {"workers": len([t for t in self.cluster.tasks if t.job == "worker"])}

    def dashboards(self, body: dict) -> dict:
        prefix = body.get("prefix")
        if not isinstance(prefix, str) or not prefix.startswith("/") or prefix.endswith("/"):
            raise ConfigurationError(f"prefix={prefix!r}: send a path like '/workbench/dashboards/NAME'.")
        require("bokeh", "the dashboards")
        server = self._dashboards.get(prefix)
        if server is None:
            server = self._dashboards[prefix] = DashboardServer(self.cluster, prefix=prefix).start()
        return {"url": server.url, "plots": [{"name": p.name, "title": p.title} for p in server.plots()]}

    # -- serving ------------------------------------------------------------------------------

    def start(self) -> ControlServer:
        try:
            self._serving.start(self._serve, START_TIMEOUT)
        except (OSError, TimeoutError) as exc:
            raise WorkbenchError(f"the control endpoint of cluster {self.cluster.name!r} did not start: {exc}") from None
        return self

    def _serve(self):
        import tornado.httpserver
        import tornado.netutil
        import tornado.web

        owner = self

        class Route(tornado.web.RequestHandler):
            def initialize(self, op: str) -> None:
                self.op = op

            def prepare(self) -> None:
                if not local_host(self.request.headers.get("Host"), owner.port):
                    self._answer(403, {"error": "this endpoint answers requests addressed to 127.0.0.1 only"})
                    return
                given = self.request.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"token {owner.token}".encode()):  # constant time
                    self._answer(403, {"error": "this endpoint needs the token from the cluster's registry record"})

            def _answer(self, status: int, body: Any) -> None:
                self.set_status(status)
                self.set_header("Content-Type", "application/json")
                self.finish(json.dumps(body))

            async def _run(self, call) -> None:
                loop = asyncio.get_running_loop()
                try:
                    result = await loop.run_in_executor(owner._work, call)
                except WorkbenchError as exc:
                    self._answer(400 if isinstance(exc, ConfigurationError) else 409, {"error": str(exc)})
                    return
                self._answer(200, result)

            def _body(self) -> dict:
                try:
                    body = json.loads(self.request.body or b"{}")
                except ValueError:
                    body = None
                if not isinstance(body, dict):
                    raise tornado.web.HTTPError(400, "send a JSON object")
                return body

            async def get(self) -> None:
                if self.op != "summary":
                    raise tornado.web.HTTPError(405)
                await self._run(owner.summary)

            async def post(self) -> None:
                if self.op == "stop":  # answered first: stopping ends this server too
                    self._answer(202, {"stopping": owner.cluster.name})
                    threading.Thread(target=owner.cluster.stop, daemon=True, name="workbench-stop").start()
                    return
                body = self._body()
                await self._run(lambda: getattr(owner, self.op)(body))

        app = tornado.web.Application([(f"/{op}", Route, {"op": op}) for op in ("summary", "scale", "stop", "dashboards", "telemetry")])
        sockets = tornado.netutil.bind_sockets(0, "127.0.0.1")
        server = tornado.httpserver.HTTPServer(app)
        server.add_sockets(sockets)
        self.port = sockets[0].getsockname()[1]
        return server.stop

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the proxied dashboard servers and this endpoint (safe from any thread but its own)."""
        for server in self._dashboards.values():
            server.stop()
        self._dashboards.clear()
        self._serving.stop(timeout)
        self._work.shutdown(wait=False)


def start_control_endpoint(cluster: Cluster) -> None:
    """Serve ``cluster``'s control endpoint until it stops, and advertise it in the registry."""
    server = ControlServer(cluster).start()
    cluster.keep("control", server, close=server.stop)
    cluster.advertise("control", server.endpoint())


Cluster.start_hooks.append(start_control_endpoint)
