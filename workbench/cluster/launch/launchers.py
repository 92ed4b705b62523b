"""Which ipyparallel launcher starts a cluster's engines, with which options, and the controller's options.

``engine_launcher_class`` finds a launcher by name ("local", "mpi", "slurm", ..., or a class path; "ssh" is
ipyparallel's, subclassed in ssh.py);
``split_launcher_options`` sorts ``wb.Cluster``'s ``**launcher_options`` between ipyparallel's ``Cluster``
and the launcher; ``controller_args`` adds the workbench's controller defaults under the user's own.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from typing import Any

from ...errors import ConfigurationError
from . import placement_hosts

# The controller's options unless the user's controller_args set them (traitlets refuses an option given twice).
# The hub confirms a new engine on the heartbeat after the one it first answered: one or two periods.
# Beat every 100 ms (the default 3 s alone added 3-6 s to every start), and allow as many seconds of
# missed beats (30) as the default before declaring an engine dead. Schedulers run as threads of the
# hub, not one process each (bench/controller.py: less memory, same throughput).
CONTROLLER_DEFAULTS = {"--HeartMonitor.period": "100", "--HeartMonitor.max_heartmonitor_misses": "300",
                       "--IPController.use_threads": "True"}
# ipyparallel's local launcher, and the workbench's (entry point "workbench-fork") that wb.Cluster(engines="local") uses
LOCAL_LAUNCHERS = ("local", "workbench-fork")
FORK_LAUNCHER = "workbench-fork"


def controller_args(given: Iterable[str]) -> list[str]:
    """The controller's command-line options: the workbench's defaults, then the user's, which win."""
    given = list(given)
    named = {arg.split("=", 1)[0] for arg in given}
    return [f"{key}={value}" for key, value in CONTROLLER_DEFAULTS.items() if key not in named] + given


def engine_launcher_class(name: str) -> type:
    """ipyparallel's engine launcher class for ``name`` ("local", "mpi", "slurm", ...)."""
    from importlib.metadata import entry_points

    from ipyparallel.cluster.launcher import find_launcher_class

    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"engines={name!r} is not a launcher name: use e.g. engines='local'.")
    try:
        return _with_workbench_ssh(find_launcher_class(name, "engine"))
    except (KeyError, ImportError, AttributeError):
        pass
    if "." in name:  # a full class path, as ipyparallel also accepts
        module, _, cls = name.rpartition(".")
        try:
            return _with_workbench_ssh(getattr(__import__(module, fromlist=[cls]), cls))
        except (ImportError, AttributeError):
            pass
    if name == FORK_LAUNCHER:  # the workbench's own, registered by installing the package
        raise ConfigurationError(
            f"the workbench's local engine launcher ({FORK_LAUNCHER!r}) is not registered with ipyparallel: the workbench "
            "is imported from a folder (PYTHONPATH, a checkout) rather than installed in this Python. Install it: "
            "pip install jupyter-tf-workbench, or in a checkout pip install -e ."
        )
    known = sorted(ep.name for ep in entry_points(group="ipyparallel.engine_launchers"))
    raise ConfigurationError(
        f"engines={name!r} is not a known ipyparallel engine launcher: use one of {', '.join(known)} "
        "(or a full launcher class path)."
    )


def _with_workbench_ssh(cls: type) -> type:
    """ipyparallel's SSH engine launcher -> the workbench's subclass of it (launch/ssh.py); any other as it is."""
    from ipyparallel.cluster.launcher import SSHEngineSetLauncher

    from .ssh import SSHEngineSetLauncher as WorkbenchSSHEngineSetLauncher

    return WorkbenchSSHEngineSetLauncher if cls is SSHEngineSetLauncher else cls


def parse_launcher_options(pairs: Iterable[str]) -> dict[str, Any]:
    """``KEY=VALUE`` texts (``%wb start --option``, the panel's form) as ``wb.Cluster`` keyword arguments: a value
    is a Python literal if it reads as one (``2``, ``['-i', 'key']``, ``{'node1': 2}``), else the text itself."""
    options: dict[str, Any] = {}
    for pair in (p.strip() for p in pairs):
        if not pair:
            continue
        key, equals, value = pair.partition("=")
        key = key.strip()
        if not equals or not key.isidentifier():
            raise ConfigurationError(f"launcher option {pair!r}: write KEY=VALUE, KEY an option of the launcher "
                                     "(e.g. ssh_args=['-i', 'key'] or queue=gpu).")
        try:
            options[key] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            options[key] = value.strip()
    return options


def split_launcher_options(launcher_cls: type, options: dict[str, Any]) -> tuple[dict, dict]:
    """Split ``**launcher_options`` into ipyparallel ``Cluster`` traits and engine-launcher traits."""
    from ipyparallel import Cluster as IPPCluster

    cluster_traits = set(IPPCluster.class_trait_names(config=True)) | {"profile", "profile_dir", "controller_ip"}
    launcher_traits = set(launcher_cls.class_trait_names(config=True))
    reserved = {"n", "cluster_id", "engine_launcher_class", "engines", "shutdown_atexit"}
    cluster_kwargs, launcher_kwargs, unknown = {}, {}, []
    options = dict(options)
    if "hosts" in options:
        launcher_kwargs["engines"] = placement_hosts.validate(launcher_cls, options.pop("hosts"))
    for key, value in options.items():
        if key in reserved:
            raise ConfigurationError(f"{key!r} is set by the workbench; leave it out of the launcher options.")
        if key in cluster_traits:
            cluster_kwargs[key] = value
        elif key in launcher_traits:
            launcher_kwargs[key] = value
        else:
            unknown.append(key)
    if unknown:
        raise ConfigurationError(
            f"unknown launcher option(s) {', '.join(map(repr, sorted(unknown)))} for engines launched by "
            f"{launcher_cls.__name__}. Options it accepts: {', '.join(sorted(launcher_traits))}; and "
            f"ipyparallel Cluster options: {', '.join(sorted(cluster_traits))}."
        )
    return cluster_kwargs, launcher_kwargs


def is_mpi(launcher_cls: type) -> bool:
    from ipyparallel.cluster.launcher import MPILauncher

    return issubclass(launcher_cls, MPILauncher)
