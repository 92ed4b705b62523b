"""Bokeh internals the workbench uses, behind one function here (checked on: ``compat.FENCES``).

- ``allow_websocket_origins(server, origins)``: pages of these origins may open a Bokeh server's websocket
  (its Tornado application, ``Server._tornado``), once the server chose its port.
"""

from __future__ import annotations

from typing import Any


def allow_websocket_origins(server: Any, origins: set[str]) -> None:
    """Let pages from ``origins`` (``"127.0.0.1:5006"``) open the websocket of a started ``bokeh.server.server.Server``."""
    server._tornado.websocket_origins.update(origins)
