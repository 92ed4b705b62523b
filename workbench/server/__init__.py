"""The Jupyter server extension: REST routes under ``/workbench/api/`` and the proxied dashboards."""

from __future__ import annotations


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "workbench.server"}]


def _load_jupyter_server_extension(server_app) -> None:
    from .handlers import routes
    from .manager import ClusterManager

    web_app = server_app.web_app
    manager = web_app.settings["workbench_manager"] = ClusterManager()
    web_app.add_handlers(".*$", routes(web_app.settings["base_url"], manager))
    server_app.log.info("workbench: REST routes under %sworkbench/api/", web_app.settings["base_url"])


def _unload_jupyter_server_extension(server_app) -> None:
    """The server stops: stop the clusters started from the panel (their engines and TF servers)."""
    manager = server_app.web_app.settings.get("workbench_manager")
    if manager is not None:
        manager.stop_owned()
