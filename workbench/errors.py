"""The one error hierarchy of the workbench.

Every message says what failed, why, and what to do next. Callers catch
``WorkbenchError`` to handle anything the workbench raises on purpose. Each error's traceback
ends with a ``help:`` line (an exception note) and each warning's message with a link: the
troubleshooting page's section about its class (``docs/guide/troubleshooting.md``).
"""

from __future__ import annotations

HELP_PAGE = "https://github.com/workbench-dev/workbench/blob/main/docs/guide/troubleshooting.md"
# the classes with a section of their own on that page; any other links to its nearest ancestor's
DOCUMENTED = frozenset({
    "WorkbenchError", "ConfigurationError", "ClusterStartError", "EngineStartTimeout", "TensorFlowImportError",
    "VersionMismatchError", "ServerStartError", "ClusterStateError", "ControllerLost", "UnknownTaskError",
    "TrainingError", "ParameterServerLost", "CallbackError", "WorkbenchWarning", "LowMemoryWarning",
    "ExposedPortsWarning", "EngineForkWarning", "LauncherOptionsWarning", "UncheckedVersionWarning", "TaskFaultWarning",
    "TrackingWarning",
})


def help_url(kind: type) -> str:
    """The troubleshooting page's section about ``kind``, an error or warning class (or its nearest documented base)."""
    name = next((k.__name__ for k in kind.__mro__ if k.__name__ in DOCUMENTED), "")
    return f"{HELP_PAGE}#{name.lower()}" if name else HELP_PAGE


def described(exc: BaseException) -> str:
    """An error's message with its notes (the help link), for what shows an error's text rather than its traceback."""
    return "\n".join([str(exc), *getattr(exc, "__notes__", ())])


def first_line(exc: BaseException, limit: int = 160) -> str:
    """An error's first line (TensorFlow's own message where it has one), at most ``limit`` characters: what a
    one-line notice quotes of it (TensorFlow's gRPC errors go on for lines of "Additional GRPC error information")."""
    text = str(getattr(exc, "message", exc)).strip().splitlines()
    return (text[0] if text else "")[:limit]


class WorkbenchError(Exception):
    """Base class of every error the workbench raises on purpose."""

    def __init__(self, *args):
        super().__init__(*args)
        self.add_note(f"help: {help_url(type(self))}")


class WorkbenchWarning(UserWarning):
    """Base class of the workbench's warnings; each message ends with the link to its troubleshooting section."""

    def __str__(self) -> str:
        return f"{super().__str__()} (help: {help_url(type(self))})"


class ConfigurationError(WorkbenchError, ValueError):
    """Arguments that cannot work, detected before anything starts."""


class ClusterStartError(WorkbenchError):
    """Starting the engine pool or its TensorFlow servers failed.

    Everything that had been started is stopped before this is raised.
    """


class EngineStartTimeout(ClusterStartError):
    """Fewer engines registered than were asked for, within the time allowed."""


class TensorFlowImportError(ClusterStartError):
    """An engine could not import TensorFlow."""


class VersionMismatchError(ClusterStartError):
    """An engine runs different TensorFlow or workbench versions than the client."""


class ServerStartError(ClusterStartError):
    """A TensorFlow server could not be started on an engine."""


class ClusterStateError(WorkbenchError):
    """The operation does not fit the cluster's current state (e.g. stopped)."""


class UnknownTaskError(WorkbenchError, KeyError):
    """A task name such as ``worker:9`` that the cluster does not have."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class LowMemoryWarning(WorkbenchWarning):
    """Starting local engines would likely use more memory than this machine or container has free."""


class ExposedPortsWarning(WorkbenchWarning):
    """TensorFlow ports of the workbench listen on every network interface, unauthenticated; the message names them."""


class EngineForkWarning(WorkbenchWarning):
    """Local engines were started as separate processes instead of forks of the warm process (the message says why)."""


class LauncherOptionsWarning(WorkbenchWarning):
    """The workbench added options to the engine launcher's command (e.g. mpiexec's --allow-run-as-root); the message says which and why."""


class UncheckedVersionWarning(WorkbenchWarning):
    """An installed library's version is outside the range the workbench's use of its internals was checked on;
    the message says which features may break and what to install."""


class TaskFaultWarning(WorkbenchWarning):
    """A task was lost, went silent or straggles, and what the workbench did about it (re-hosted it, restored a checkpoint...)."""


class TrackingWarning(WorkbenchWarning):
    """An experiment tracker (``wb.tracking``) could not take what a job logged: the job goes on, and its run stops
    being updated; the message names the tracker, the job and the error."""


class ControllerLost(ClusterStateError):
    """The cluster's ipyparallel controller exited: the cluster was stopped (nothing it started is left running)."""


class TrainingError(WorkbenchError):
    """A training job failed; the message names the task and, where there is one, the checkpoint."""


class ParameterServerLost(TrainingError):
    """A ps task became unreachable and the job does not recover (``recovery=None``): its variables lived there."""
