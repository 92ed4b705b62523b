"""The Jupyter server extension: REST routes under ``/workbench/api/`` for the JupyterLab panel."""

from __future__ import annotations


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "workbench.server"}]


def _load_jupyter_server_extension(server_app) -> None:
    from .handlers import routes
    from .manager import ClusterManager

    web_app = server_app.web_app
    web_app.add_handlers(".*$", routes(web_app.settings["base_url"], ClusterManager()))
    server_app.log.info("workbench: REST routes under %sworkbench/api/", web_app.settings["base_url"])
