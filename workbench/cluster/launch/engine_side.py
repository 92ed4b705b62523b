"""Functions the client runs on engines (through ipyparallel) to give each engine its TF task.

Each engine hosts at most one ``tf.distribute.Server``; it is kept in ``_SERVER`` so that it
lives as long as the engine. Functions return plain dicts, never raise for expected failures:
the client turns them into messages that name the engine.
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any

from ...compat import tensorflow as tf_compat
from ...errors import ConfigurationError
from ..machine import threads
from ..machine.gpus import discover_gpus
from ..process import bind_hook, containment

_SERVER: dict[str, Any] = {}
_PORT_ATTEMPTS = 8
_CLONE_NEWNET = 0x40000000


def _workbench_version() -> str:
    from ..._version import __version__

    return __version__


def route_address(controller_ip: str) -> str:
    """The address other tasks should use to reach this engine.

    It is the local address of the route towards the controller: loopback for a local pool,
    the interface facing the cluster network otherwise. A UDP ``connect`` sends no packet.
    """
    if controller_ip in ("", "*", "0.0.0.0", "::"):
        return socket.gethostname()
    family = socket.AF_INET6 if ":" in controller_ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe_socket:
        try:
            probe_socket.connect((controller_ip, 9))
            return probe_socket.getsockname()[0]
        except OSError:
            return socket.gethostname()


def probe(controller_ip: str, lifeline: str = "") -> dict[str, Any]:
    """Who and where this engine is, before TensorFlow is used; holds the client's ``lifeline`` if given.

    The address other tasks reach this engine on is also the one its TensorFlow ports will listen on
    (``containment.BIND_ENV``, read by the bind shim), unless the user set one.
    """
    if lifeline:
        ensure_lifeline(lifeline)
    address = route_address(controller_ip)
    if containment.BIND_ENV not in os.environ:
        _SERVER["bind_chosen"] = False
        if _is_address(address):
            os.environ[containment.BIND_ENV] = address
        else:  # a host name: which of its interfaces the other tasks use is not known here
            os.environ[containment.BIND_ENV] = containment.EVERY_INTERFACE
            _SERVER["exposed_because"] = (f"{socket.gethostname()} knows its address only as the name {address!r}: pass "
                                          "controller_ip=<the cluster network's address of this machine> so that "
                                          "every task binds the interface facing the others")
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "address": address,
        "gpus": discover_gpus(),
        "python": sys.executable,
        "python_version": ".".join(map(str, sys.version_info[:3])),
        "workbench_version": _workbench_version(),
        "tensorflow_loaded": "tensorflow" in sys.modules,
    }


def devices_untouched() -> bool:
    """True while TensorFlow has not set up devices in this process, so ``CUDA_VISIBLE_DEVICES`` still applies.

    An engine forked from the warm process has TensorFlow imported but no device initialised: the
    warm process never runs an op, lists devices or starts a server.
    """
    if "server" in _SERVER:
        return False
    return not tf_compat.context_created()


def import_tensorflow(visible_gpus: list[str] | None) -> dict[str, Any]:
    """Import TensorFlow with ``visible_gpus`` as ``CUDA_VISIBLE_DEVICES`` (``None``: leave as is)."""
    started = time.monotonic()
    if visible_gpus is not None and devices_untouched():
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpus)
    try:
        import tensorflow as tf
    except BaseException as exc:  # noqa: BLE001 - reported to the client with the engine's name
        return {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(limit=4),
            "python": sys.executable,
        }
    return {
        "ok": True,
        "version": getattr(tf, "__version__", "unknown"),
        "seconds": time.monotonic() - started,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def prepare_tensorflow(visible_gpus: list[str] | None) -> dict[str, Any]:
    """``import_tensorflow(visible_gpus)``, and a port reserved for the TF server when that worked."""
    result = import_tensorflow(visible_gpus)
    if result["ok"]:
        result["port"] = reserve_port()
    return result


def reserve_port() -> int:
    """A port that is free on this engine now (the server binds it right after)."""
    with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def start_profiler_server(attempts: int = 3) -> int:
    """Start TensorFlow's profiler service on this engine once; return its port (the same on later calls)."""
    import tensorflow as tf

    if "profiler_port" in _SERVER:
        return _SERVER["profiler_port"]
    for attempt in range(attempts):
        port = reserve_port()
        try:
            tf.profiler.experimental.server.start(port)
        except Exception:  # the port was taken in between: reserve another
            if attempt == attempts - 1:
                raise
            continue
        _SERVER["profiler_port"] = port
        return port
    raise RuntimeError("unreachable")


def join_namespace(path: str, address: str) -> None:
    """Move this engine's main thread into the network namespace at ``path``, where it has ``address``.

    Only the calling thread moves (a namespace is per thread): the engine's own connections to its
    controller, opened before, stay where they are, while the TF server and every thread TensorFlow
    starts from here on listen and connect inside. So it must run on the thread that runs TensorFlow,
    before TensorFlow starts a thread of its own (an engine forked from the warm process has none).
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("join_namespace must run on the engine's main thread (the one that runs TensorFlow)")
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into the task's network namespace failed: {os.strerror(error)}")
    finally:
        os.close(fd)
    os.environ[containment.BIND_ENV] = address  # the bind shim puts wildcard binds there
    _SERVER["namespace"] = path


def start_server(spec: dict[str, list[str]], job: str, index: int, port: int | None = None,
                 namespace: dict | None = None, sharing: int = 1) -> dict[str, Any]:
    """Start this engine's ``tf.distribute.Server`` for ``job:index`` of ``spec``.

    ``port``: the port to listen on when ``spec`` names another one for this task (a link emulator
    forwards that one here); None: listen where ``spec`` says. ``namespace``: ``{"path", "address"}``
    of the task's own network namespace, joined first (``join_namespace``). If the port was taken
    since it was reserved, pick another and try again: the returned ``address`` is the one named in
    the spec and ``serving`` the port actually listened on. ``sharing``: how many tasks share this machine's
    cores, this one included, as ``machine.threads`` counts them; the server's intra-op pool takes its share.
    """
    import tensorflow as tf
    from tensorflow.core.protobuf import config_pb2, tensorflow_server_pb2

    existing = _SERVER.get("server")
    if namespace is not None and existing is None and _SERVER.get("namespace") != namespace["path"]:
        try:
            join_namespace(namespace["path"], namespace["address"])
        except (OSError, RuntimeError) as exc:
            return {"ok": False, "error": f"could not join the task's network namespace: {exc}"}
    if existing is not None:
        if (_SERVER["job"], _SERVER["index"]) == (job, index):
            return _describe(tf, _SERVER["address"], job, index, _SERVER["serving"], reused=True)
        return {
            "ok": False,
            "error": (
                f"this engine already hosts the TensorFlow task {_SERVER['job']}:{_SERVER['index']} "
                f"(a server cannot be stopped inside a running process); restart the engine to give it "
                f"the role {job}:{index}."
            ),
        }
    spec = {name: list(addresses) for name, addresses in spec.items()}
    host = spec[job][index].rsplit(":", 1)[0]
    if not containment.shim_loaded():  # an engine the workbench did not start (the user's own ipcluster)
        unprotected = bind_hook.protect_or_reason()
        if unprotected and containment.PROBLEM_ENV not in os.environ:  # else the client's reason, with what to do, says it
            _SERVER.setdefault("exposed_because", unprotected)
    try:
        threads.share_cores(sharing)
        session_config = threads.apply(config_pb2.ConfigProto())
    except ConfigurationError as exc:
        return {"ok": False, "error": str(exc)}
    errors = []
    for _attempt in range(_PORT_ATTEMPTS):
        definition = tensorflow_server_pb2.ServerDef(
            cluster=tf.train.ClusterSpec(spec).as_cluster_def(), job_name=job, task_index=index, protocol="grpc",
            port=port or 0, default_session_config=session_config)
        try:
            server = tf.distribute.Server(definition, start=True)
        except (tf.errors.UnknownError, tf.errors.UnavailableError) as exc:
            # "Could not start gRPC server": the port was taken between reservation and start.
            errors.append(f"{port or spec[job][index]}: {exc.message if hasattr(exc, 'message') else exc}")
            if port:
                port = reserve_port()
            else:
                spec[job][index] = f"{host}:{reserve_port()}"
            continue
        address = spec[job][index]
        serving = port or int(address.rsplit(":", 1)[1])
        _SERVER.update(server=server, job=job, index=index, address=address, serving=serving)
        return _describe(tf, address, job, index, serving, retries=len(errors))
    return {"ok": False, "error": "could not bind a port for the TensorFlow server: " + "; ".join(errors)}


def _describe(tf: Any, address: str, job: str, index: int, serving: int, reused: bool = False,
              retries: int = 0) -> dict:
    prefix = f"/job:{job}/replica:0/task:{index}"
    # Physical devices: listing logical ones would initialize this process's eager context, after
    # which MultiWorkerMirroredStrategy (strategy="allreduce") can no longer be set up here.
    devices = [f"{prefix}/device:{d.device_type}:{d.name.rsplit(':', 1)[-1]}" for d in tf.config.list_physical_devices()]
    return {
        "ok": True,
        "address": address,
        "serving": serving,
        "devices": devices,
        "retries": retries,
        "reused": reused,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def _is_address(text: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in text else socket.AF_INET, text)
    except OSError:
        return False
    return True


def listening() -> dict[str, Any]:
    """What this engine listens on; whether that was meant (the user's own ``"*"``), and if not, why it happened."""
    chosen = _SERVER.get("bind_chosen", True) and os.environ.get(containment.BIND_ENV) == containment.EVERY_INTERFACE
    why = _SERVER.get("exposed_because") or ("" if containment.shim_loaded() else os.environ.get(containment.PROBLEM_ENV, (
        "its engine was not started by the workbench: give that pool's engines LD_PRELOAD=$(jupyter-tf-workbench bind-shim), or "
        "start them with the workbench's engine command (python -m workbench.cluster.launch.engine_main)")))
    return {"listeners": containment.listeners(), "chosen": chosen, "why": why}


def release() -> bool:
    """Mark this engine's role as released.

    TensorFlow cannot stop a server inside a running process, so the gRPC server keeps
    listening until the engine exits; a later attach with the same role reuses it.
    """
    if "server" not in _SERVER:
        return False
    _SERVER["released"] = True
    return True


def ensure_lifeline(value: str) -> bool:
    """Hold the client's lifeline if this engine's bootstrap did not (e.g. a custom ``engine_cmd``)."""
    from .lifeline import hold_lifeline, holding_lifeline

    if holding_lifeline():
        return False
    hold_lifeline(value)
    return True
