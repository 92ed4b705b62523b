"""Thin, authenticated handlers over ``ClusterManager``.

- ``/workbench/api/...``: the REST routes the panel calls (JSON shapes in ``models.py``).
- ``/workbench/dashboards/<cluster>/...``: the owner's Bokeh apps, proxied (HTTP and websocket)
  so that the browser reaches them through this server, authenticated, with no extra port.
"""

from __future__ import annotations

import asyncio
import html
import json
import os
import time
from collections.abc import Callable
from typing import Any

import tornado.httpclient
import tornado.iostream
import tornado.web
import tornado.websocket
from jupyter_core.utils import ensure_async
from jupyter_server.auth.decorator import ws_authenticated
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from jupyter_server.utils import url_path_join
from tornado.ioloop import IOLoop

from ..errors import WorkbenchError
from .manager import BadRequest, ClusterManager, NotFound, OwnerError
from .models import ENGINE_LAUNCHERS, ErrorBody

PROXY_TIMEOUT = 30.0
LIST_WAIT = 10.0  # seconds a waiting list request is held at most (then answered as it is)
LIST_CHECK = 0.2  # seconds between looks at the registry while one waits
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "server", "date"}


def _status_of(exc: WorkbenchError) -> int:
    if isinstance(exc, NotFound):
        return 404
    if isinstance(exc, BadRequest):
        return 400
    if isinstance(exc, OwnerError):
        return 409
    return 500  # a cluster that failed to start: its message says why and what to do


class _Base(APIHandler):
    def initialize(self, manager: ClusterManager) -> None:
        self.manager = manager

    async def answer(self, call: Callable[[], Any], status: int = 200) -> None:
        """Run a (blocking) manager call on a thread; answer its JSON, or an ``ErrorBody``."""
        try:
            result = await IOLoop.current().run_in_executor(None, call)
        except WorkbenchError as exc:
            self.fail(exc)
            return
        self.set_status(status)
        self.finish(json.dumps(result))

    def fail(self, exc: WorkbenchError) -> None:
        """Answer ``exc`` as an ``ErrorBody`` with its status."""
        code = _status_of(exc)
        self.set_status(code)
        self.finish(json.dumps(ErrorBody(str(exc), code).to_json()))

    def json_body(self) -> Any:
        """The request's JSON (called inside ``answer``, so that a bad body is a 400 ``ErrorBody``)."""
        if not self.request.body:  # a request that starts or scales processes says what it wants
            raise BadRequest("the request has no body: send a JSON object.")
        try:
            return json.loads(self.request.body)
        except (ValueError, RecursionError):
            raise BadRequest("the request body is not JSON: send a JSON object.") from None

    def proxy_prefix(self, name: str) -> str:
        return url_path_join(self.base_url, "workbench", "dashboards", name)


class ClustersHandler(_Base):
    @tornado.web.authenticated
    async def get(self) -> None:
        """The clusters and a ``version`` of the list. With ``?after=<version>``, answered once the list differs
        from that version (a cluster starting, a job beginning or ending, a task lost) or after ``LIST_WAIT`` s:
        the panel learns of a change within a fraction of a second without polling fast."""
        after = self.get_query_argument("after", None)
        loop, deadline = IOLoop.current(), time.monotonic() + (LIST_WAIT if after else 0.0)
        while True:
            try:
                listing = await loop.run_in_executor(None, self.manager.listing)
            except WorkbenchError as exc:
                self.fail(exc)
                return
            if listing["version"] != after or time.monotonic() >= deadline or self.request.connection.stream.closed():
                self.finish(json.dumps(listing))
                return
            await asyncio.sleep(LIST_CHECK)

    @tornado.web.authenticated
    async def post(self) -> None:
        """Start a cluster owned by this server, from the panel's form (``StartForm``)."""
        await self.answer(lambda: self.manager.start(self.json_body()).to_json(), status=201)


class ClusterHandler(_Base):
    @tornado.web.authenticated
    async def get(self, name: str) -> None:
        await self.answer(lambda: self.manager.cluster(name).to_json())

    @tornado.web.authenticated
    async def patch(self, name: str) -> None:
        """Scale: ``{"workers": n}``."""
        def scale() -> dict:
            body = self.json_body()
            return self.manager.scale(name, body.get("workers") if isinstance(body, dict) else None).to_json()

        await self.answer(scale)

    @tornado.web.authenticated
    async def delete(self, name: str) -> None:
        """Stop; answered once the owner has stopped it."""
        await self.answer(lambda: (self.manager.stop(name), {"stopped": name})[1])


class PlotsHandler(_Base):
    @tornado.web.authenticated
    async def get(self, name: str) -> None:
        prefix = self.proxy_prefix(name)
        await self.answer(lambda: {"cluster": name, "plots": [p.to_json() for p in self.manager.plots(name, prefix)]})


class SummaryHandler(_Base):
    @tornado.web.authenticated
    async def get(self, name: str) -> None:
        def summary() -> dict:
            job = self.manager.summary(name)
            return {"cluster": name, "job": job.to_json() if job is not None else None}

        await self.answer(summary)


class OptionsHandler(_Base):
    """What the "new cluster" form offers: launchers and the ipyparallel profiles found."""

    @tornado.web.authenticated
    async def get(self) -> None:
        await self.answer(lambda: {"engines": list(ENGINE_LAUNCHERS), "profiles": _ipython_profiles()})


def _ipython_profiles() -> list[str]:
    from IPython.paths import get_ipython_dir

    root = get_ipython_dir()
    if not os.path.isdir(root):
        return []
    return sorted(d[len("profile_"):] for d in os.listdir(root) if d.startswith("profile_"))


# -- the dashboards, proxied -------------------------------------------------------------------


UNAVAILABLE = """<!doctype html><html><head><meta charset="utf-8"><title>{title}</title><style>
body {{ font: 13px/1.5 system-ui, -apple-system, 'Segoe UI', sans-serif; color: #333; margin: 24px; }}
.wb-unavailable {{ max-width: 640px; border-left: 4px solid #ff9f1c; background: #fff8ee; padding: 10px 14px; }}
h1 {{ font-size: 15px; margin: 0 0 6px; }} p {{ margin: 4px 0; }} .why {{ color: #666; }}
</style></head><body><div class="wb-unavailable" data-cluster="{cluster}"><h1>{title}</h1><p>{what}</p>
<p class="why">{why}</p></div></body></html>
"""


def unavailable_page(cluster: str, exc: WorkbenchError) -> str:
    """What a plot pane shows when its cluster's plots cannot be had: most often a pane JupyterLab restored after
    the cluster stopped."""
    if isinstance(exc, NotFound):
        title, what = (f"Cluster {cluster!r} is not running", "Its plots ended with it. Close this pane; when a cluster "
                       "of this name runs again, open its plots from the Workbench panel (or reload this pane).")
    else:
        title, what = f"The plots of cluster {cluster!r} are unavailable", "Reload this pane to try again."
    return UNAVAILABLE.format(cluster=html.escape(cluster), title=html.escape(title), what=html.escape(what),
                              why=html.escape(str(exc)))


class DashboardProxy(JupyterHandler):
    """``GET <base>/workbench/dashboards/<cluster>/<path>`` -> the owner's Bokeh server, same path."""

    def initialize(self, manager: ClusterManager) -> None:
        self.manager = manager

    @tornado.web.authenticated
    async def get(self, name: str, path: str) -> None:
        prefix = url_path_join(self.base_url, "workbench", "dashboards", name)
        try:
            upstream = await IOLoop.current().run_in_executor(None, self.manager.upstream, name, prefix)
        except WorkbenchError as exc:
            self.set_status(_status_of(exc))
            self.set_header("Content-Type", "text/html; charset=utf-8")
            self.finish(unavailable_page(name, exc))
            return
        url = f"{upstream}/{path}" + (f"?{self.request.query}" if self.request.query else "")
        response = await tornado.httpclient.AsyncHTTPClient().fetch(url, raise_error=False,
                                                                    request_timeout=PROXY_TIMEOUT)
        if response.code == 599:  # no answer at all
            self.manager.forget_upstream(name)
            self.set_status(502)
            self.finish(f"workbench: the dashboards of {name!r} did not answer ({response.error}); reload to retry.\n")
            return
        self.set_status(response.code)
        for key, value in response.headers.get_all():
            if key.lower() not in _HOP_HEADERS:
                self.set_header(key, value)
        self.finish(response.body)


class DashboardSocketProxy(JupyterHandler, tornado.websocket.WebSocketHandler):
    """The Bokeh session's websocket (``.../<plot>/ws``), relayed both ways to the owner."""

    def initialize(self, manager: ClusterManager) -> None:
        self.manager = manager
        self.upstream: tornado.websocket.WebSocketClientConnection | None = None

    async def pre_get(self, name: str, path: str) -> None:
        prefix = url_path_join(self.base_url, "workbench", "dashboards", name)
        try:
            base = await IOLoop.current().run_in_executor(None, self.manager.upstream, name, prefix)
        except WorkbenchError as exc:
            raise tornado.web.HTTPError(_status_of(exc), str(exc)) from None
        host = base.split("/", 3)[2]
        url = "ws://" + base.split("://", 1)[1] + f"/{path}" + (f"?{self.request.query}" if self.request.query else "")
        protocols = [p.strip() for p in self.request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        request = tornado.httpclient.HTTPRequest(url, headers={"Origin": f"http://{host}"},
                                                 connect_timeout=PROXY_TIMEOUT, request_timeout=PROXY_TIMEOUT)
        try:
            self.upstream = await tornado.websocket.websocket_connect(
                request, subprotocols=protocols or None, on_message_callback=self._from_upstream)
        except (OSError, tornado.httpclient.HTTPClientError) as exc:
            self.manager.forget_upstream(name)
            raise tornado.web.HTTPError(502, f"the dashboards of {name!r} did not accept the session: {exc}") from None

    @ws_authenticated
    async def get(self, name: str, path: str) -> None:
        # The origin first: a page of another site must not reach the owner at all (pre_get opens a session there).
        if not self.check_origin(self.request.headers.get("Origin", "")):
            raise tornado.web.HTTPError(403, "a websocket from another site than this server's is refused")
        await ensure_async(self.pre_get(name, path))
        try:
            result = super().get(name, path)
            if result is not None:
                await result
        finally:
            if self.ws_connection is None:  # the handshake was refused: the owner's session must not linger
                self.on_close()

    def select_subprotocol(self, subprotocols: list[str]) -> str | None:
        return subprotocols[0] if subprotocols else None

    def on_message(self, message: str | bytes) -> None:
        if self.upstream is not None:
            self._relay(self.upstream.write_message, message)

    def _from_upstream(self, message: str | bytes | None) -> None:
        if message is None:  # the owner closed the session (or stopped)
            self.close()
            return
        self._relay(self.write_message, message)

    def _relay(self, write, message: str | bytes) -> None:
        """Send ``message`` on with ``write``; a side that closed meanwhile ends the session, quietly.

        A write returns a future that fails if the socket closes before the bytes left (the browser's
        tab went, the owner stopped): it is looked at here, or asyncio would log its traceback as
        "Task exception was never retrieved" in the server's log.
        """
        try:
            sent = write(message, binary=isinstance(message, bytes))
        except tornado.websocket.WebSocketClosedError:
            self.on_close()
            return
        sent.add_done_callback(self._sent)

    def _sent(self, sent) -> None:
        if sent.cancelled():
            return
        error = sent.exception()
        if isinstance(error, (tornado.websocket.WebSocketClosedError, tornado.iostream.StreamClosedError)):
            self.on_close()
        elif error is not None:
            self.log.warning("workbench: relaying a dashboard message failed: %r", error)

    def on_close(self) -> None:
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            upstream.close()


def routes(base_url: str, manager: ClusterManager) -> list[tuple]:
    api = url_path_join(base_url, "workbench", "api")
    boards = url_path_join(base_url, "workbench", "dashboards")
    name = r"([^/]+)"
    kwargs = {"manager": manager}
    return [
        (url_path_join(api, "options"), OptionsHandler, kwargs),
        (url_path_join(api, "clusters"), ClustersHandler, kwargs),
        (url_path_join(api, "clusters", name), ClusterHandler, kwargs),
        (url_path_join(api, "clusters", name, "plots"), PlotsHandler, kwargs),
        (url_path_join(api, "clusters", name, "summary"), SummaryHandler, kwargs),
        (url_path_join(boards, name, r"(.*/ws)"), DashboardSocketProxy, kwargs),
        (url_path_join(boards, name, r"(.*)"), DashboardProxy, kwargs),
    ]
