"""Quiet cells: TensorFlow's, absl's and gRPC's own log lines from a notebook kernel go to a log file.

Those libraries write from C++ straight to file descriptor 2, and a Jupyter kernel shows whatever
reaches it as red stderr in the running cell: TensorFlow's start-up lines (oneDNN, cpu_feature_guard,
"Started server"), absl's "All log messages before absl::InitializeLog()", and every gRPC
"Failed to connect" block while a killed task is re-hosted (tutorial 03's kill cell printed 234
lines). In a kernel, ``route()`` points descriptor 2 at ``log_path()``; Python's own ``sys.stderr``
(warnings, tracebacks, the workbench's one-line notices) is the kernel's stream object, not the
descriptor, so it still reaches the cell. A plain script's lines go to its cluster's log file from its
first connection on (a re-hosted task's "Failed to connect" blocks), while its ``sys.stderr`` is moved to
a copy of the old descriptor 2 and so still reaches the terminal. Set ``WORKBENCH_NATIVE_LOGS=cell`` (or
``stderr``) to keep the lines where they were.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
import warnings
from pathlib import Path

OPT_OUT_ENV = "WORKBENCH_NATIVE_LOGS"
_LOCK = threading.Lock()
_ROUTED: dict[str, str] = {}


def in_kernel() -> bool:
    """Whether this process is a Jupyter (ipykernel) kernel whose stderr the cells show."""
    return type(sys.stderr).__module__.startswith("ipykernel")


def log_path() -> str:
    """Where this kernel's native log lines go now ("" when they are not routed: outside a kernel, or opted out)."""
    return _ROUTED.get("path", "")


def cluster_log_path(cluster_name: str) -> str:
    """The file this process's native lines go to while it is a client of ``cluster_name`` ("" when not routed)."""
    if not route() and not _script_may_route():
        return ""
    return str(_log_directory() / f"cluster-{cluster_name}-{os.getpid()}.log")


def _opted_out() -> bool:
    return os.environ.get(OPT_OUT_ENV, "").lower() in ("cell", "stderr")


def _log_directory() -> Path:
    from .cluster.process.containment import cache_dir

    return Path(cache_dir()) / "logs"


def _script_may_route() -> bool:
    """A plain script whose ``sys.stderr`` is its own descriptor 2 (not a kernel's stream, not pytest's capture)."""
    if in_kernel() or _opted_out() or sys.stderr is None or sys.stderr is not sys.__stderr__:
        return False
    try:
        return sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):
        return False


def _route_script(path: str, header: str) -> bool:
    """A plain script's first connection: descriptor 2 goes to ``path``; Python's ``sys.stderr`` (warnings,
    tracebacks, the workbench's notices) keeps writing where descriptor 2 went before. ``_LOCK`` held."""
    if not _script_may_route():
        return False
    sys.stderr.flush()
    terminal = os.dup(2)
    try:
        Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _point(2, path, header)
    except OSError:
        os.close(terminal)
        return False  # the lines stay where they were
    stream = open(terminal, "w", buffering=1, encoding=sys.stderr.encoding, errors=sys.stderr.errors)  # noqa: SIM115
    sys.stderr = sys.__stderr__ = stream
    if faulthandler.is_enabled():  # a crash's stack still reaches the terminal
        faulthandler.enable(file=stream)
    _ROUTED["path"] = path
    return True


def hint() -> str:
    """`` TensorFlow's own log lines: <file>.`` for an error message, when they go to a file; else ``""``."""
    path = log_path()
    return f" TensorFlow's own log lines: {path}." if path else ""


def _point(descriptor: int, path: str | Path, header: str = "") -> None:
    """``descriptor`` appends to ``path`` (created 0600; ``header`` written first). ``OSError`` if it cannot be opened."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    if header:
        os.write(fd, f"{time.strftime('%Y-%m-%d %H:%M:%S')} {header}\n".encode())
    os.dup2(fd, descriptor)
    os.close(fd)


def route_to(path: str, header: str = "") -> bool:
    """From now on, descriptor 2 goes to ``path`` (appended; ``header`` written first); False when not routed."""
    with _LOCK:
        if not path:
            return False
        if "path" not in _ROUTED:
            return _route_script(path, header)  # a kernel routed at import: this is a script's first connection
        if _ROUTED["path"] != path:
            try:
                _point(2, path, header)
            except OSError:
                return False  # the lines stay where they were
            _ROUTED["path"] = path
        return True


def route() -> str:
    """In a kernel, send descriptor 2 to a log file of this process (once); return its path, or ``""``."""
    with _LOCK:
        if "path" in _ROUTED:
            return _ROUTED["path"]
        if not in_kernel() or _opted_out():
            return ""
        directory = _log_directory()
        path = directory / f"kernel-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}.log"
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            _point(2, path)
        except OSError:
            return ""  # no log file: the lines stay where they were
        _ROUTED["path"] = str(path)
        return str(path)


@contextlib.contextmanager
def stdout_to_log():
    """While it lasts, descriptor 1 goes to the log file too (when the lines are routed; else nothing changes).

    For a call that prints from C++ to standard output, which a kernel shows in the cell: TensorFlow's
    profiler client writes "Starting to trace for 2000 ms. Remaining attempt(s): 0". Only around such a
    call: the rest of the time, what the user's own code writes there (``os.system``) still reaches the cell.
    """
    path = log_path()
    if not path:
        yield
        return
    saved = os.dup(1)
    try:
        _point(1, path)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


NOTICE_FILE = "<workbench notice>"  # where a notice "comes from": shown as nothing (see _format)


def notice(message: str, category: type[Warning], source: str) -> None:
    """A warning raised from one of the workbench's own threads (a job's, the health monitor's), shown as one line.

    ``warnings.warn`` there can only point at library source lines, which say nothing to the user; a notice
    names what it comes from once, at its start (``source``, e.g. ``job async-ps-3``), and shows no file or
    line: ``TaskFaultWarning: job async-ps-3: worker:1 ...``. Filters apply as for any warning.
    """
    said = message if not source or message.startswith(f"{source}:") else f"{source}: {message}"
    warnings.warn_explicit(said, category, filename=NOTICE_FILE, lineno=0, module="workbench")


_format_warning = warnings.formatwarning


def _format(message, category, filename, lineno, line=None) -> str:
    """Python's warning format, but a notice (``NOTICE_FILE``) is its category and its words, without a place."""
    if filename == NOTICE_FILE:
        return f"{category.__name__}: {message}\n"
    return _format_warning(message, category, filename, lineno, line)


warnings.formatwarning = _format


def inform(message: str, source: str) -> None:
    """A change the user asked for (a scale), said as one line of information on standard output: not a warning."""
    print(f"{source}: {message}", file=sys.stdout, flush=True)
