"""Bokeh internals the workbench uses, behind one function here (checked on: ``compat.FENCES``).

- ``allow_websocket_origins(server, origins)``: pages of these origins may open a Bokeh server's websocket
  (its Tornado application, ``Server._tornado``), once the server chose its port.
- ``load(server=False)``: Bokeh's modules imported one thread at a time. Bokeh's imports are not thread-safe:
  defining its model classes toggles one process-wide flag (``Property._should_validate``), and two threads
  importing its modules at once fail (``failed to validate GlyphRenderer.view`` or a ``_DeadlockError``). A
  kernel meets that when its first ``wb.dashboard(...)`` runs while the JupyterLab panel has the kernel serve
  the same cluster's plots from another thread. Every workbench path into Bokeh calls this first.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

# what the notebook dashboards and profiles import, and what serving them adds
MODULES = ("bokeh.models", "bokeh.plotting", "bokeh.layouts", "bokeh.transform", "bokeh.io", "bokeh.resources")
SERVER_MODULES = ("bokeh.application", "bokeh.application.handlers.function", "bokeh.server.server")
_IMPORTING = threading.Lock()


def load(server: bool = False) -> None:
    """Import Bokeh's modules the workbench uses (with ``server``, the Bokeh server's too), one thread at a time."""
    with _IMPORTING:
        for name in MODULES + (SERVER_MODULES if server else ()):
            importlib.import_module(name)


def allow_websocket_origins(server: Any, origins: set[str]) -> None:
    """Let pages from ``origins`` (``"127.0.0.1:5006"``) open the websocket of a started ``bokeh.server.server.Server``."""
    server._tornado.websocket_origins.update(origins)
