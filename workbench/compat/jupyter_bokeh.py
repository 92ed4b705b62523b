"""jupyter_bokeh internals the workbench uses, behind one function here (checked on: ``compat.FENCES``).

- ``live_widget_class(lock)``: ``jupyter_bokeh.BokehModel`` made live: it reads the widget's root model and
  its private ``_model_to_traits`` to send the document as it is now, and wraps its ``_sync_model`` (what
  the browser sends back) in the dashboard's lock.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("workbench.dashboard")


def live_widget_class(lock: threading.Lock) -> type:
    """``jupyter_bokeh.BokehModel`` whose whole state, when a frontend asks for it, is the plots as they are now.

    BokehModel sends the document once, as it was when the widget was made, then only patches, and a
    view drops the patches sent before it rendered. So a page reloaded while a job trains would
    show the plots as they were at display time plus what streamed since: the timeline's history
    gone. A frontend that (re)loads asks for every widget's whole state; here that state is the
    document as it is then, taken under the dashboard's lock so that no update is half made.

    What the browser sends back (a range BokehJS computed, a tool's event) is applied to the same
    document by the kernel's comm thread; that too takes the lock. Without it, the live thread adding a
    worker's lines raced it ("Set changed size during iteration" in Bokeh's change notification) and the
    widget stopped updating for good (3 of about 40 runs of the browser test here).

    An event the kernel cannot apply (it names a model the live document has dropped since, a value the
    model refuses) is dropped, counted in ``dropped_events`` and logged in one line at debug level on the
    ``workbench.dashboard`` logger. Raised, ipywidgets would hand it to IPython's ``showtraceback``, which
    on a loaded machine spent minutes highlighting the traceback while the kernel answered nothing; and the
    browser's events here are views of the plots (ranges, sizes, tool events), which nothing depends on.
    """
    from bokeh.core.json_encoder import serialize_json
    from jupyter_bokeh import BokehModel

    class LiveBokehModel(BokehModel):
        def get_state(self, key=None, drop_defaults=False):
            state = super().get_state(key, drop_defaults)
            if key is None and "render_bundle" in state and self._model.document is not None:
                with lock:
                    state["render_bundle"] = serialize_json(self._model_to_traits(self._model))
            return state

        dropped_events = 0  # events from the browser that could not be applied (see above)

        def _sync_model(self, model, content, buffers):
            try:
                with lock:
                    super()._sync_model(model, content, buffers)
            except Exception as exc:  # noqa: BLE001 - any of them: the event is a view's, dropping it loses nothing
                self.dropped_events += 1
                log.debug("dashboard widget: dropped a browser event (%s): %s: %s",
                          content.get("kind", "unknown kind"), type(exc).__name__, exc)

        def close(self):  # once: jupyter_bokeh's raises KeyError the second time (ipywidgets closes again at GC)
            if not getattr(self, "_closed_once", False):
                self._closed_once = True
                super().close()

    return LiveBokehModel
