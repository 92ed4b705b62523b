"""What the launcher and each engine use of the warm process, without being it.

Requests to it over its unix socket (``request``; ``start_forked_nanny``, which an engine forked from it
uses for its ipyparallel nanny), and the checks that say whether a fork is safe (``fork_problem``:
one thread, no GPU driver, no TensorFlow runtime) and whether an engine's environment can be served
by a fork (``import_time_mismatch``, ``adopt_import_time``). The warm process itself (``warm.py``)
uses them too; it imports this module, never the other way round.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import select
import socket
import sys
import threading

from ...compat import tensorflow as tf_compat
from ..process.connection import CLIENT_ENVIRONMENT

# Environment variables read when these libraries load: an engine forked from here runs with the
# values the warm process had, so a request that sets them differently cannot be served by a fork.
_IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "TF_", "OMP_", "KMP_", "MKL_", "OPENBLAS_")
# Not read at import either: the settings a kernel gives itself when it connects to a cluster as its
# client (TensorFlow reads them at run time, in the client). Engines started after that connection
# inherit them; they must not cost those engines their fork.
_NOT_IMPORT_TIME = ("TF_CONFIG", "PYTHONUNBUFFERED", *CLIENT_ENVIRONMENT)
# Shared libraries whose presence means a GPU runtime may have been initialised: no fork after that.
_GPU_DRIVERS = ("libcuda.so", "libamdhip64.so", "libhsa-runtime64.so")
MAX_MESSAGE = 1 << 20
REQUEST_TIMEOUT = 10.0
WARM_LOG = "warm.log"  # the warm process's log, beside its socket in the private directory its client made



class WarmError(RuntimeError):
    """The warm process could not be reached, or refused a request; the message says why."""


def request(path: str, message: dict, fds: list[int] | tuple = (), timeout: float = REQUEST_TIMEOUT) -> dict:
    """Send one request to the warm process at ``path`` and return its reply (raises ``WarmError``)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            data = json.dumps(message).encode()
            if fds:
                socket.send_fds(sock, [data], list(fds))
            else:
                sock.sendall(data)
            reply = sock.recv(MAX_MESSAGE)
        except (OSError, TimeoutError) as exc:
            raise WarmError(f"the warm process at {path} did not answer ({type(exc).__name__}: {exc})") from None
    if not reply:
        raise WarmError(f"the warm process at {path} closed the connection without answering")
    answer = json.loads(reply)
    if "error" in answer:
        raise WarmError(answer["error"])
    return answer


def start_forked_nanny(path: str, kwargs: dict, timeout: float = 30.0) -> tuple[str, object]:
    """Have the warm process at ``path`` fork a nanny for this engine (``kwargs`` as ipyparallel's ``start_nanny``).

    Returns what ipyparallel's ``start_nanny`` does: the nanny's URL, and an object to keep while the
    engine runs (the read end of the nanny's pipe: when the engine exits it closes, and the nanny
    tells the controller).
    """
    read_end, write_end = os.pipe()
    try:
        payload = base64.b64encode(pickle.dumps({**kwargs, "pid": os.getpid()})).decode()
        request(path, {"op": "nanny", "kwargs": payload}, fds=[write_end, sys.stderr.fileno()], timeout=timeout)
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    reader = os.fdopen(read_end, "rb")
    ready, _, _ = select.select([reader], [], [], timeout)
    line = reader.readline() if ready else b""
    if not line.strip():
        reader.close()
        raise WarmError(f"the nanny forked for engine pid {os.getpid()} did not report its address within {timeout:.0f} s")
    return line.decode().strip(), reader


def _import_time(name: str) -> bool:
    return name.startswith(_IMPORT_TIME_PREFIXES) and name not in _NOT_IMPORT_TIME


def import_time_mismatch(ours: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """Names of import-time variables that differ between two environments."""
    return sorted(k for k in {*ours, *theirs} if _import_time(k) and ours.get(k) != theirs.get(k))


def adopt_import_time(env: dict[str, str], warm: dict[str, str], keep=()) -> dict[str, str]:
    """``env`` with the import-time variables of ``warm`` (the warm process's), except those named in ``keep``."""
    adopted = {k: v for k, v in env.items() if not _import_time(k) or k in keep}
    adopted.update({k: v for k, v in warm.items() if _import_time(k) and k not in keep})
    return adopted


def gpu_driver_loaded(maps: str = "/proc/self/maps") -> str:
    """The GPU driver library mapped into this process, or ``""``."""
    try:
        with open(maps) as handle:
            for line in handle:
                for name in _GPU_DRIVERS:
                    if name in line:
                        return line.rsplit(None, 1)[-1]
    except OSError:
        pass
    return ""


def fork_problem() -> str:
    """Why forking this process now would be unsafe, or ``""`` when it is safe."""
    threads = threading.enumerate()
    if len(threads) > 1:
        names = ", ".join(t.name for t in threads if t is not threading.main_thread())
        return (f"the warm process runs {len(threads)} threads (also: {names}); a fork copies locks a thread may hold, "
                "so engines could deadlock")
    driver = gpu_driver_loaded()
    if driver:
        return (f"the GPU driver ({driver}) was loaded in the warm process while importing, and a process forked "
                "after that cannot use the GPU safely")
    if tf_compat.context_created():
        return "TensorFlow's runtime was started in the warm process (a preloaded module ran TensorFlow code)"
    return ""
