"""A server on its own thread and event loop, beside the kernel's (the dashboards, the control endpoint)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable


def local_host(host_header: str | None, port: int) -> bool:
    """Whether a request's ``Host`` names this machine's loopback server on ``port``.

    A page on another site that rebinds its own name to 127.0.0.1 (DNS rebinding) reaches a local
    server with that name in ``Host``: refusing it keeps such pages from reading local routes.
    """
    return host_header in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}")


class ServingThread:
    """Runs ``setup()`` on a new event loop in a daemon thread, then serves until ``stop()``.

    ``setup`` starts the server(s) and returns the function that stops them. An error in it is
    raised again by ``start()`` in the caller's thread, as is.
    """

    def __init__(self, name: str):
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, setup: Callable[[], Callable[[], None]], timeout: float) -> None:
        ready, failure = threading.Event(), []

        def serve() -> None:
            loop = self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                shutdown = setup()
            except BaseException as exc:  # noqa: BLE001 - raised again by start() in the caller's thread
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            shutdown()
            loop.close()

        self._thread = threading.Thread(target=serve, daemon=True, name=self.name)
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError(f"{self.name} did not start within {timeout:.0f} s")
        if failure:
            self._thread = None
            raise failure[0]

    @property
    def running(self) -> bool:
        return self._thread is not None

    @property
    def native_id(self) -> int | None:
        """The serving thread's id in the operating system (what its CPU time is read by), or None."""
        return self._thread.native_id if self._thread is not None else None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and end the thread (from any thread; from its own, without waiting)."""
        thread, self._thread = self._thread, None
        if thread is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        if thread is not threading.current_thread():
            thread.join(timeout)
