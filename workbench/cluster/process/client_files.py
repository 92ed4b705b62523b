"""A TensorFlow client's own temporary files: autograph's generated sources, in a directory of the process.

Every function TensorFlow converts (each ``tf.function`` a job or a ``%%wb on`` cell traces) is written
by autograph as ``__autograph_generated_file*.py`` into the system's temporary directory, and removed
by an exit handler. A kernel that is killed (SIGKILL, the OOM killer, a crash) runs none, and its
files stay: tens per job. Once this process is a client of a cluster (``connection.connect``), autograph
writes them under ``workbench-client-<pid>@<host>-*/`` instead: removed when the process exits, and,
when it was killed, by the next workbench process on that host that connects (``sweep``). The host is
in the name because a temporary directory can be shared (a network filesystem, a container with
process ids of its own): a pid is judged only by a process of the host that made the directory.

Local engines write under their cluster's scratch directory. An engine that another launcher started
(Slurm, MPI, SSH) takes a directory like a client's for all it writes (``adopt_temporary_directory``):
swept the same way once it was killed.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import socket
import tempfile
import threading
import types
from pathlib import Path

import psutil

from ...compat import tensorflow as tf_compat
from ..machine.processes import CREATED_SLACK

PREFIX = "workbench-client-"
_LOCK = threading.Lock()
_OURS: dict[str, str] = {}


def directory() -> str:
    """This process's directory for autograph's sources (``""`` until ``adopt_autograph``)."""
    return _OURS.get("path", "")


def adopt_autograph() -> str:
    """Point autograph's generated files at this process's own directory (once); return that directory.

    ``""`` when TensorFlow's loader is not what this was written for (then files go where they always did).
    """
    with _LOCK:
        if "path" in _OURS:
            return _OURS["path"]
        loader = tf_compat.autograph_loader()
        if getattr(loader, "tempfile", None) is not tempfile:
            return ""
        path = _own_directory()
        loader.tempfile = types.SimpleNamespace(NamedTemporaryFile=functools.partial(tempfile.NamedTemporaryFile, dir=path))
        _OURS["path"] = path
        return path


def adopt_temporary_directory() -> str:
    """Everything this process writes to the temporary directory goes under one of its own (an engine that
    Slurm, MPI or SSH started: killed at its cluster's stop, it runs no exit handler); return it.

    Nothing changes when the process already has a cluster's scratch directory as ``$TMPDIR``.
    """
    current = os.environ.get("TMPDIR", "")
    if Path(current).name.startswith("workbench-"):
        return current
    path = _own_directory()
    os.environ["TMPDIR"] = tempfile.tempdir = path
    return path


def _own_directory() -> str:
    """A new ``workbench-client-<pid>@<host>-*`` directory, removed when this process exits (``sweep`` if it is killed)."""
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}@{socket.gethostname()}-")
    atexit.register(shutil.rmtree, path, True)
    return path


def _owner_pid(path: Path) -> int | None:
    """The pid in ``path``'s name when a process of this host made it; ``None`` for another host's (or not ours).

    ``mkdtemp``'s random suffix has no ``-``, so the host is what lies between ``@`` and the last ``-``.
    Names without a host (``workbench-client-<pid>-*``, from before) count as this host's.
    """
    pid, at, rest = path.name[len(PREFIX):].partition("@")
    if at and rest.rpartition("-")[0] != socket.gethostname():
        return None
    try:
        return int(pid if at else pid.split("-", 1)[0])
    except ValueError:
        return None


def _owner_gone(path: Path) -> bool:
    """Whether the process of this host that made ``path`` (pid in its name) is gone: dead, or its pid reused since."""
    pid = _owner_pid(path)
    if pid is None:
        return False  # another host's process ids are not this one's to judge
    try:
        made = path.stat().st_mtime
    except OSError:
        return False
    try:
        return psutil.Process(pid).create_time() > made + CREATED_SLACK  # a newer process took the pid
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False  # not ours to judge (another user's)


def sweep(root: str | None = None) -> list[str]:
    """Remove the client directories whose process is gone; return what was removed."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        if path.is_dir() and path.stat().st_uid == os.getuid() and _owner_gone(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed
