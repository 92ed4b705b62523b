"""Thin, authenticated REST handlers over ``ClusterManager``: ``/workbench/api/...``."""

from __future__ import annotations

import json

import tornado.web
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from .manager import BadRequest, ClusterManager, NotFound
from .models import ErrorBody


class _Base(APIHandler):
    def initialize(self, manager: ClusterManager) -> None:
        self.manager = manager

    def answer_error(self, exc: Exception) -> None:
        status = 404 if isinstance(exc, NotFound) else 400
        self.set_status(status)
        self.finish(json.dumps(ErrorBody(str(exc), status).to_json()))


class ClustersHandler(_Base):
    @tornado.web.authenticated
    def get(self) -> None:
        self.finish(json.dumps({"clusters": [c.to_json() for c in self.manager.clusters()]}))


class ClusterHandler(_Base):
    @tornado.web.authenticated
    def get(self, name: str) -> None:
        try:
            self.finish(json.dumps(self.manager.cluster(name).to_json()))
        except (BadRequest, NotFound) as exc:
            self.answer_error(exc)


def routes(base_url: str, manager: ClusterManager) -> list[tuple]:
    api = url_path_join(base_url, "workbench", "api")
    return [
        (url_path_join(api, "clusters"), ClustersHandler, {"manager": manager}),
        (url_path_join(api, "clusters", r"([^/]+)"), ClusterHandler, {"manager": manager}),
    ]
