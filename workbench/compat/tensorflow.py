"""TensorFlow internals the workbench uses, each behind one function here (checked on: ``compat.FENCES``).

- ``eager_context()``: the process's eager context (``tensorflow.python.eager.context``): its server def, updated
  in place when a cluster is scaled or a task re-hosted (``get_server_def``/``update_server_def``), its config
  (``_config``), which the tasks' thread pools follow, and its device scope (``device_name``).
- ``context_created()``: whether that context exists yet (TensorFlow's runtime started), without importing it.
- ``run_on_own_executor(work)``: a thread's ops on a synchronous executor of its own (``pywrap_tfe`` and the
  context's ``_context_handle``), so that a stalled task's calls do not block the other threads'.
- ``sharded_variable(shards, name)``: a variable split over the ps tasks (``ShardedVariable``).
- ``xspace()``: an empty profiler capture message (``tensorflow.tsl``'s ``XSpace``), to parse a task's trace.
- ``autograph_loader()``: the module whose temporary files autograph writes (pointed at a directory of the process).
- ``guard_context_changes()``: a function's registration and removal take turns with a change of the context's
  server def, process-wide (``context_change()``). TensorFlow registers a new function on every task it is
  connected to, reading the list of tasks and then each task's client: an update that removed a task between the
  two failed the registration with "Client for target /job:worker/replica:0/task:2 not found" (a job whose worker
  was re-hosted while the cluster was scaled down traced its next step beside the update). Freeing a
  ``tf.function`` removes it from every task; TensorFlow's binding of ``TFE_ContextRemoveFunction`` keeps the GIL
  while the removal goes to every remote task and their answers come back: one round of RPCs during which no
  thread of the kernel runs Python (0.4 s seen with two busy cores, 2.4 s on a loaded CI machine; a task that does
  not answer froze the kernel). The same C function called through ``ctypes`` runs with the GIL released and
  raises the same errors. Where its symbols cannot be found (a build that does not export them), TensorFlow's own
  binding stays (and takes its turn all the same).
- ``context_change()``: held while the context's server def is set or updated, and while a function is registered
  or removed.
- ``quiet_retracing_of(*names)``: TensorFlow's "triggered tf.function retracing" warning (a logging record of its
  logger) dropped for the workbench's own functions made anew on purpose (one per job, one per re-hosting).
  TensorFlow counts traces per code object, not per function, so a few of them in a row read to it as one
  function retraced, a warning that would send the user hunting for a loop of theirs. A user's own function
  still warns.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
_LOCK = threading.Lock()
_STATE: dict = {"guarded": False, "why_not": ""}
_CONTEXT_CHANGE = threading.RLock()  # a server def set or updated, a function registered or removed: one at a time
_DEFAULT_EXECUTOR: list = []  # the default executor's handle, read once: each thread returns to it
_DEFAULT_EXECUTOR_LOCK = threading.Lock()


_OWN_FUNCTIONS: set[str] = set()  # qualified names whose retracing warning is dropped
_OWN_FUNCTIONS_LOCK = threading.Lock()


class _OwnRetracing(logging.Filter):
    """Drops TensorFlow's retracing warning when it names one of ``_OWN_FUNCTIONS``; any other passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "triggered tf.function retracing" not in message or not any(
            f"<function {name} at " in message for name in _OWN_FUNCTIONS)


def quiet_retracing_of(*names: str) -> None:
    """Drop the retracing warning for the functions of these qualified names (the filter installed once)."""
    with _OWN_FUNCTIONS_LOCK:
        _OWN_FUNCTIONS.update(names)
        logger = logging.getLogger("tensorflow")
        if not any(isinstance(f, _OwnRetracing) for f in logger.filters):
            logger.addFilter(_OwnRetracing())


def context_change() -> threading.RLock:
    """Hold it (``with context_change():``) while setting or updating the eager context's server def."""
    return _CONTEXT_CHANGE


def eager_context() -> Any:
    """This process's eager context (created on first use)."""
    from tensorflow.python.eager import context

    return context.context()


def context_created() -> bool:
    """Whether this process's eager context exists (its runtime started); imports nothing."""
    context = sys.modules.get("tensorflow.python.eager.context")
    return context is not None and getattr(context, "_context", None) is not None


def context_config(context: Any) -> Any:
    """The ``ConfigProto`` a context was created with (None when it was given none)."""
    return getattr(context, "_config", None)


def set_context_config(context: Any, config: Any) -> None:
    """The config the context hands to the tasks it connects to next (its remote contexts' thread pools)."""
    context._config = config


def run_on_own_executor(work: Callable) -> Callable:
    """``work`` wrapped to run its ops on a synchronous executor of its own, then go back to the default one.

    Not ``context.executor_scope``: leaving it drops a wrapper of the default executor, whose ``__del__`` waits
    for *every* thread's pending work, and so hangs behind a stalled task. So the thread switches with the raw
    handles that ``context.executor`` itself uses. An error a lost task left on the executor is cleared here.
    """

    @functools.wraps(work)
    def run(*args, **kwargs):
        from tensorflow.python import pywrap_tfe
        from tensorflow.python.eager import executor

        ctx = eager_context()
        ctx.ensure_initialized()
        with _DEFAULT_EXECUTOR_LOCK:
            if not _DEFAULT_EXECUTOR:  # a new thread starts on the default executor
                _DEFAULT_EXECUTOR.append(pywrap_tfe.TFE_ContextGetExecutorForThread(ctx._context_handle))
        own = executor.new_executor(enable_async=False, enable_streaming_enqueue=False)
        ctx.executor = own
        try:
            return work(*args, **kwargs)
        finally:
            pywrap_tfe.TFE_ContextSetExecutorForThread(ctx._context_handle, _DEFAULT_EXECUTOR[0])
            try:
                own.wait()
            except Exception:  # noqa: BLE001 - the work function has classified it already
                own.clear_error()

    return run


def sharded_variable(shards: list, name: str) -> Any:
    """One variable made of ``shards`` (each on its own device), as ``ParameterServerStrategy`` makes them."""
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    return ShardedVariable(shards, name=name)


def xspace() -> Any:
    """An empty ``XSpace`` message (what a task's profiler capture holds)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    return xplane_pb2.XSpace()


def autograph_loader() -> Any:
    """Autograph's loader module, whose ``tempfile`` attribute makes the files of converted functions."""
    from tensorflow.python.autograph.pyct import loader

    return loader


def guard_context_changes() -> str:
    """Make this process's function registrations and removals take turns with its server def's changes (once per
    process), removals through the C API with the GIL released.

    Returns ``""`` when removals release the GIL, else why TensorFlow's own binding of them stays (it then holds
    the GIL, as before); registrations and removals take their turns either way."""
    with _LOCK:
        if not _STATE["guarded"]:
            _take_turns_in_registration()
            try:
                _install_removal()
            except (OSError, AttributeError, ImportError) as exc:
                _STATE["why_not"] = f"{type(exc).__name__}: {exc}"
                log.debug("function removal keeps TensorFlow's binding (it holds the GIL): %s", _STATE["why_not"])
                _take_turns(_context_module().Context, "remove_function")
            _STATE["guarded"] = True
        return _STATE["why_not"]


def _context_module() -> Any:
    from tensorflow.python.eager import context

    return context


def _take_turns(owner: type, name: str) -> None:
    """``owner.name`` made to hold ``context_change()`` while it runs."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def in_turn(self, *args, **kwargs):
        with _CONTEXT_CHANGE:
            return original(self, *args, **kwargs)

    setattr(owner, name, in_turn)


def _take_turns_in_registration() -> None:
    context = _context_module().Context
    for name in ("add_c_function", "add_function_def"):
        _take_turns(context, name)


def _library(directory: str, stem: str) -> ctypes.CDLL:
    suffix = ".2.dylib" if sys.platform == "darwin" else ".so.2"
    return ctypes.CDLL(os.path.join(directory, f"lib{stem}{suffix}"))


def _install_removal() -> None:
    import tensorflow as tf
    from tensorflow.python.framework import errors_impl

    context = _context_module()
    directory = os.path.dirname(tf.__file__)
    eager, framework = _library(directory, "tensorflow_cc"), _library(directory, "tensorflow_framework")
    remove = eager.TFE_ContextRemoveFunction
    remove.argtypes, remove.restype = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p], None
    new_status, delete_status = framework.TF_NewStatus, framework.TF_DeleteStatus
    new_status.restype, delete_status.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    code_of, message_of = framework.TF_GetCode, framework.TF_Message
    code_of.argtypes, message_of.argtypes, message_of.restype = [ctypes.c_void_p], [ctypes.c_void_p], ctypes.c_char_p
    pointer = ctypes.pythonapi.PyCapsule_GetPointer
    pointer.argtypes, pointer.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_void_p

    def remove_function(self, name) -> None:  # TensorFlow's Context.remove_function, the GIL released
        self.ensure_initialized()
        status = new_status()
        try:
            with _CONTEXT_CHANGE:
                remove(pointer(self._handle, None), name.encode() if isinstance(name, str) else name, status)
            code = code_of(status)
            if code:
                raise errors_impl.exception_type_from_error_code(code)(None, None, message_of(status).decode(errors="replace"))
        finally:
            delete_status(status)

    remove_function.__doc__ = context.Context.remove_function.__doc__
    context.Context.remove_function = remove_function
