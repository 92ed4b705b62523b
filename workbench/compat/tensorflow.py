"""TensorFlow internals the workbench uses, each behind one function here (checked on: ``compat.FENCES``).

- ``eager_context()``: the process's eager context (``tensorflow.python.eager.context``): its server def, updated
  in place when a cluster is scaled or a task re-hosted (``get_server_def``/``update_server_def``), its config
  (``_config``), which the tasks' thread pools follow, and its device scope (``device_name``).
- ``context_created()``: whether that context exists yet (TensorFlow's runtime started), without importing it.
- ``connected_tasks(context)``: the tasks of which the context's runtime knows a device now (``pywrap_tfe``'s
  device list), read afresh: the context's own ``devices()`` is a copy taken at its last successful change, and an
  update that failed midway may have removed a task's devices since.
- ``run_on_own_executor(work)``: a thread's ops on a synchronous executor of its own (``pywrap_tfe`` and the
  context's ``_context_handle``), so that a stalled task's calls do not block the other threads'.
- ``sharded_variable(shards, name)``: a variable split over the ps tasks (``ShardedVariable``).
- ``dataset_options(dataset)``: a dataset's options, also while a function is traced (a job's input pipelines are
  made inside one), where ``Dataset.options()`` warns that its value is the one kept in Python (``_options_attr``).
- ``xspace()``: an empty profiler capture message (``tensorflow.tsl``'s ``XSpace``), to parse a task's trace.
- ``autograph_loader()``: the module whose temporary files autograph writes (pointed at a directory of the process).
- ``guard_context_changes()``: a function's registration and removal take turns with a change of the context's
  server def, process-wide (``context_change()``), and both run with the GIL released. TensorFlow registers a new
  function on every task it is connected to, reading the list of tasks and then each task's client: an update that
  removed a task between the two failed the registration with "Client for target /job:worker/replica:0/task:2 not
  found" (a job whose worker was re-hosted while the cluster was scaled down traced its next step beside the
  update). TensorFlow's bindings of ``TFE_ContextAddFunction`` and ``TFE_ContextRemoveFunction`` keep the GIL while
  the registration or removal goes to every remote task (one blocking Enqueue RPC each: the client's enqueue is not
  streamed) and the answers come back: no thread of the kernel runs Python meanwhile. A removal took 0.4 s with two
  busy cores and 2.4 s on a loaded CI machine, a job's input pipeline registered as the job began (one function per
  worker) 2 s here and 4.2 s on CI, and a task that does not answer froze the kernel. The same C functions called
  through ``ctypes`` run with the GIL released and raise the same errors; a registration hands over the
  ``TF_Function`` that TensorFlow's pybind11 object wraps (its pointer follows the object's header, confirmed once
  per process on a probe function by its name). Where a symbol cannot be found or the probe does not confirm the
  layout, TensorFlow's own binding stays (and takes its turn all the same).
- ``context_change()``: held while the context's server def is set or updated, and while a function is registered
  or removed.
- ``untuned_device_prefetch()``: the per-device end of a ``MultiDeviceIterator`` (what a ``tf.distribute``
  strategy feeds each replica from: a fixed prefetch, nothing to tune) made without tf.data's autotuning, as the
  workbench's own pipelines are (``training.data``), by wrapping ``multi_device_iterator_ops._create_device_dataset``.
  TensorFlow gives that pipeline default options, so its iterator ran autotuning's model thread, which sleeps
  between rounds without waking when the iterator goes: deleting an all-reduce job's input on a worker took up to
  2 s (half the jobs of a CNN, 0.26-0.76 s typically), and the engine's next call, often the next job's set-up,
  waited behind it. Where this TensorFlow has no such function it logs why and leaves TensorFlow's.
- ``generator_malloc_setting_now()``: TensorFlow's generator dataset kernel (``Dataset.from_generator``, and every
  ``tf.distribute`` strategy's per-device input: ``MultiDeviceIterator``) fixes glibc's mmap threshold at 128 KiB
  the first time a process makes it (``ApplyPython311MemoryPatch``, once per process, seen with ``gdb``). Made at a
  moment the caller chooses, by iterating a one-element generator dataset, so that it can be undone for the
  process's life (``machine.memory.keep_large_blocks_in_heap``): the per-device input a cell makes later on that
  engine no longer changes it.
- ``gradient_registrations(made)`` and ``forget_gradients(made)``: the gradient functions TensorFlow registers while a
  function traces (``ops._gradient_registry``, one entry per call of a ``tf.custom_gradient`` function in graph mode,
  named ``CustomGradient-<n>``), and their removal once the function is gone. The registry is process-wide and never
  lets an entry go, and the entry's closure holds the traced graph: ``ReplicaContext.all_reduce`` is such a function,
  so every all-reduce job's step graph stayed on its workers (on the digits MLP about 6,100 Python objects and
  6.5 MiB a job, a full garbage collection 1.4 ms after the first job and 12 ms after the tenth).
- ``clear_kernel_cache()``: the eager runtime's cached kernels dropped (``context.clear_kernel_cache``). It keeps one
  for every function it ran, the function's instantiation with it, and a job's validation and evaluation functions
  (and its step function, when the program changes) are new each job: an all-reduce worker grew by 1.4 MiB a job
  with them kept, 0.6 MiB without. Dropped, a kept function's next call instantiates it again (165 ms on the MLP).
- ``quiet_retracing_of(*names)``: TensorFlow's "triggered tf.function retracing" warning (a logging record of its
  logger) dropped for the workbench's own functions made anew on purpose (one per job, one per re-hosting).
  TensorFlow counts traces per code object, not per function, so a few of them in a row read to it as one
  function retraced, a warning that would send the user hunting for a loop of theirs. A user's own function
  still warns.
"""

from __future__ import annotations

import contextlib
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
CUSTOM_GRADIENT = "CustomGradient-"  # how TensorFlow names ``tf.custom_gradient``'s registrations


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


def connected_tasks(context: Any) -> set[str]:
    """``/job:<job>/replica:0/task:<i>`` of every task (this process's own included) ``context`` knows a device of now."""
    from tensorflow.python import pywrap_tfe

    devices = pywrap_tfe.TFE_ContextListDevices(context._handle)
    try:
        count = pywrap_tfe.TF_DeviceListCount(devices)
        return {pywrap_tfe.TF_DeviceListName(devices, i).split("/device:")[0] for i in range(count)}
    finally:
        pywrap_tfe.TF_DeleteDeviceList(devices)


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


def untuned_device_prefetch() -> bool:
    """Make every ``MultiDeviceIterator``'s per-device pipelines in this process run without tf.data's autotuning
    (see the module's docstring); once, process-wide. Whether it applies on this TensorFlow."""
    with _LOCK:
        if "device_prefetch" not in _STATE:
            _STATE["device_prefetch"] = _wrap_device_datasets()
        return _STATE["device_prefetch"]


def _wrap_device_datasets() -> bool:
    import tensorflow as tf
    from tensorflow.python.data.ops import multi_device_iterator_ops

    make = getattr(multi_device_iterator_ops, "_create_device_dataset", None)
    if make is None:
        log.warning("this TensorFlow has no multi_device_iterator_ops._create_device_dataset: an all-reduce worker's "
                    "input keeps tf.data's autotuning, and deleting it may hold the worker up to a second or two")
        return False
    options = tf.data.Options()
    options.autotune.enabled = False

    @functools.wraps(make)
    def untuned(*args, **kwargs):
        return make(*args, **kwargs).with_options(options)

    multi_device_iterator_ops._create_device_dataset = untuned
    return True


def generator_malloc_setting_now() -> bool:
    """Have TensorFlow apply its once-per-process malloc setting of generator datasets now (see the module's
    docstring), in eager mode; once, process-wide. Takes a few milliseconds. False where it failed (logged, with
    why): TensorFlow then applies it at the process's first generator dataset, as it would anyway."""
    import tensorflow as tf

    with _LOCK:
        if "generator_made" not in _STATE:
            try:
                one = tf.data.Dataset.from_generator(lambda: iter((0,)), output_signature=tf.TensorSpec((), tf.int32))
                next(iter(one))  # the kernel is made as the iterator is
                _STATE["generator_made"] = True
            except Exception as exc:  # noqa: BLE001 - a worker goes on without it, slower where its tensors are large
                log.warning("could not make a generator dataset ahead of this worker's input (%s: %s): its first one "
                            "fixes glibc's mmap threshold at 128 KiB, and tensors over that are mapped anew each time",
                            type(exc).__name__, exc)
                _STATE["generator_made"] = False
        return _STATE["generator_made"]


def clear_kernel_cache() -> None:
    """Drop the kernels this process's eager runtime cached (see the module's docstring); they are made again on use."""
    eager_context().clear_kernel_cache()


@contextlib.contextmanager
def gradient_registrations(made: list[str]):
    """Append to ``made`` the names of the gradient functions TensorFlow registers while the block runs (see the
    module's docstring): those that ``forget_gradients`` may drop once what traced them is gone."""
    registry = _gradient_registry()
    newest = next(reversed(registry), None)
    try:
        yield made
    finally:
        added = []
        for name in reversed(registry):  # TensorFlow adds each under a new name: those after ``newest`` are the block's
            if name == newest:
                break
            if name.startswith(CUSTOM_GRADIENT):
                added.append(name)
        made.extend(reversed(added))


def forget_gradients(made: list[str]) -> int:
    """Drop the gradient functions ``gradient_registrations`` listed in ``made`` (and empty it): nothing may differentiate
    the graphs that registered them any more. How many were registered."""
    registry = _gradient_registry()
    dropped = sum(registry.pop(name, None) is not None for name in made)
    made.clear()
    return dropped


def _gradient_registry() -> dict:
    from tensorflow.python.framework import ops

    return ops._gradient_registry._registry


def dataset_options(dataset: Any) -> Any:
    """``dataset``'s ``tf.data.Options``: in a traced function, those set in Python on it and its inputs."""
    from tensorflow.python.eager import context

    if context.executing_eagerly() or not hasattr(dataset, "_options_attr"):
        return dataset.options()
    return dataset._options_attr


def xspace() -> Any:
    """An empty ``XSpace`` message (what a task's profiler capture holds)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    return xplane_pb2.XSpace()


def autograph_loader() -> Any:
    """Autograph's loader module, whose ``tempfile`` attribute makes the files of converted functions."""
    from tensorflow.python.autograph.pyct import loader

    return loader


def guard_context_changes() -> str:
    """Make this process's function registrations and removals take turns with its server def's changes, both
    through the C API with the GIL released (once per process).

    Returns ``""`` when both release the GIL, else why TensorFlow's own binding of one stays (it then holds the
    GIL, as before); registrations and removals take their turns either way."""
    with _LOCK:
        if not _STATE["guarded"]:
            context = _context_module().Context
            reasons = []
            for name, install in (("add_c_function", _install_registration), ("remove_function", _install_removal)):
                try:
                    install(_CApi.load())
                except (OSError, AttributeError, ImportError, LookupError) as exc:
                    reasons.append(f"{name}: {type(exc).__name__}: {exc}")
                    log.debug("%s keeps TensorFlow's binding (it holds the GIL): %s", name, exc)
                    _take_turns(context, name)
            _take_turns(context, "add_function_def")  # a serialised FunctionDef: loaded SavedModels, legacy Defun
            _STATE["why_not"] = "; ".join(reasons)
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


def _library(directory: str, stem: str) -> ctypes.CDLL:
    suffix = ".2.dylib" if sys.platform == "darwin" else ".so.2"
    return ctypes.CDLL(os.path.join(directory, f"lib{stem}{suffix}"))


class _CApi:
    """The C functions of TensorFlow's that ``guard_context_changes`` calls through ``ctypes``, found once."""

    _loaded: _CApi | None = None

    def __init__(self) -> None:
        import tensorflow as tf
        from tensorflow.python.framework import errors_impl

        directory = os.path.dirname(tf.__file__)
        self.eager, framework = _library(directory, "tensorflow_cc"), _library(directory, "tensorflow_framework")
        self.new_status, self.delete_status = framework.TF_NewStatus, framework.TF_DeleteStatus
        self.new_status.restype, self.delete_status.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        self.code_of, self.message_of = framework.TF_GetCode, framework.TF_Message
        self.code_of.argtypes, self.message_of.argtypes = [ctypes.c_void_p], [ctypes.c_void_p]
        self.message_of.restype = ctypes.c_char_p
        self.capsule = ctypes.pythonapi.PyCapsule_GetPointer
        self.capsule.argtypes, self.capsule.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_void_p
        self.error_type = errors_impl.exception_type_from_error_code

    @classmethod
    def load(cls) -> _CApi:
        if cls._loaded is None:
            cls._loaded = cls()
        return cls._loaded

    def call(self, function: Any, context: Any, argument: Any) -> None:
        """``function(the context's TFE_Context, argument, status)`` (ctypes drops the GIL for the call) under
        ``context_change()``; TensorFlow's error for a failed status."""
        context.ensure_initialized()
        status = self.new_status()
        try:
            with _CONTEXT_CHANGE:
                function(self.capsule(context._handle, None), argument, status)
            code = self.code_of(status)
            if code:
                raise self.error_type(code)(None, None, self.message_of(status).decode(errors="replace"))
        finally:
            self.delete_status(status)


def _function_pointer(c_func: Any) -> int:
    """The ``TF_Function*`` a pybind11 ``TF_Function`` object holds: the first word after the object's header."""
    return ctypes.c_void_p.from_address(id(c_func) + object.__basicsize__).value or 0


def _probe_function_layout(api: _CApi) -> type:
    """Confirm ``_function_pointer`` on a function made for the purpose (its name read back through the C API);
    return the pybind11 type it holds for. ``LookupError`` when it does not."""
    from tensorflow.python.client import pywrap_tf_session
    from tensorflow.python.framework import ops

    name_of = api.eager.TF_FunctionName
    name_of.argtypes, name_of.restype = [ctypes.c_void_p], ctypes.c_char_p
    with ops.Graph()._c_graph.get() as c_graph:
        probe = pywrap_tf_session.TF_GraphToFunction_wrapper(c_graph, "workbench_layout_probe", False, [], [], [], [],
                                                             [], [], None, "")
    try:
        pointer = _function_pointer(probe)
        if not pointer or name_of(pointer) != b"workbench_layout_probe":
            raise LookupError("a TF_Function object does not hold its pointer where pybind11's simple layout puts it")
        return type(probe)
    finally:
        pywrap_tf_session.TF_DeleteFunction(probe)


def _install_registration(api: _CApi) -> None:
    context = _context_module()
    add = api.eager.TFE_ContextAddFunction
    add.argtypes, add.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p], None
    function_type = _probe_function_layout(api)
    original = context.Context.add_c_function

    def add_c_function(self, c_func) -> None:  # TensorFlow's Context.add_c_function, the GIL released
        if type(c_func) is not function_type:
            with _CONTEXT_CHANGE:
                return original(self, c_func)
        return api.call(add, self, _function_pointer(c_func))

    add_c_function.__doc__ = original.__doc__
    context.Context.add_c_function = add_c_function


def _install_removal(api: _CApi) -> None:
    context = _context_module()
    remove = api.eager.TFE_ContextRemoveFunction
    remove.argtypes, remove.restype = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p], None

    def remove_function(self, name) -> None:  # TensorFlow's Context.remove_function, the GIL released
        api.call(remove, self, name.encode() if isinstance(name, str) else name)

    remove_function.__doc__ = context.Context.remove_function.__doc__
    context.Context.remove_function = remove_function
