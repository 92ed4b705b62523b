"""TensorFlow internals: the client's function removal, made without holding the GIL.

Freeing a ``tf.function`` (a finished job's step functions, collected at the job's end) calls
``Context.remove_function``, whose binding to ``TFE_ContextRemoveFunction`` keeps the GIL while the removal goes
to every remote task and their answers come back: one round of RPCs during which no thread of the kernel runs
Python (0.4 s seen with two busy cores, 2.4 s on a loaded CI machine; a task that does not answer froze the kernel).
The same C function called through ``ctypes`` runs with the GIL released, and raises the same errors.

Checked on TensorFlow 2.21, the version pyproject.toml admits (Linux wheels: the C API's symbols are exported by
``libtensorflow_cc`` and ``libtensorflow_framework``). Where they cannot be found, TensorFlow's own binding stays.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading

log = logging.getLogger(__name__)
_LOCK = threading.Lock()
_STATE: dict = {"installed": False, "why_not": ""}


def release_gil_in_function_removal() -> str:
    """Route this process's function removals through the C API with the GIL released (once per process).

    Returns ``""`` once done, else why TensorFlow's own binding stays (it then holds the GIL, as before)."""
    with _LOCK:
        if not _STATE["installed"] and not _STATE["why_not"]:
            try:
                _install()
                _STATE["installed"] = True
            except (OSError, AttributeError, ImportError) as exc:
                _STATE["why_not"] = f"{type(exc).__name__}: {exc}"
                log.debug("function removal keeps TensorFlow's binding (it holds the GIL): %s", _STATE["why_not"])
        return _STATE["why_not"]


def _library(directory: str, stem: str) -> ctypes.CDLL:
    suffix = ".2.dylib" if sys.platform == "darwin" else ".so.2"
    return ctypes.CDLL(os.path.join(directory, f"lib{stem}{suffix}"))


def _install() -> None:
    import tensorflow as tf
    from tensorflow.python.eager import context
    from tensorflow.python.framework import errors_impl

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
            remove(pointer(self._handle, None), name.encode() if isinstance(name, str) else name, status)
            code = code_of(status)
            if code:
                raise errors_impl.exception_type_from_error_code(code)(None, None, message_of(status).decode(errors="replace"))
        finally:
            delete_status(status)

    remove_function.__doc__ = context.Context.remove_function.__doc__
    context.Context.remove_function = remove_function
