"""The worker engines of an all-reduce job, called together, and what is sent to them.

``portable`` pickles the user's model, data, loss and optimizer for the engines (code from modules
they may not have travels by value); ``WorkerGroup`` calls every worker engine at once and forms the
MultiWorkerMirroredStrategy group on ports they reserve beside their TF servers.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

from ....cluster.launch import engine_side
from ....cluster.launch.calls import Deadline, RemoteCallFailed, RemoteCallsTimedOut, await_engines, start_on_engines
from ....errors import ClusterStateError, ConfigurationError, TrainingError
from . import engine as allreduce_engine

GROUP_TIMEOUT = 120.0  # forming the group and building the model on every worker


def _is_installed(module_name: str) -> bool:
    """True for modules an engine can import by name (the standard library, site-packages)."""
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if module is None or path is None:
        return module_name in sys.builtin_module_names
    resolved = str(Path(path).resolve())
    return "site-packages" in resolved or "dist-packages" in resolved or resolved.startswith(str(Path(sys.base_prefix).resolve()))


def _local_modules(items: tuple, limit: int = 500) -> set[str]:
    """The modules of the functions and classes in ``items``, and of the module-level ones they use (through their
    globals, nested functions and closures, transitively; at most ``limit`` objects looked at), that the engines
    may not be able to import: a notebook's ``make_model`` calling a helper from a local, uninstalled module."""
    found: set[str] = set()
    seen: set[int] = set()
    todo = [item for item in items if callable(item)]
    while todo and len(seen) < limit:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        module = getattr(obj, "__module__", None)
        if not isinstance(module, str) or module.startswith("workbench") or _is_installed(module):
            continue
        if module != "__main__":
            found.add(module)
        codes = [getattr(obj, "__code__", None)]
        scope = getattr(obj, "__globals__", {})
        while codes:
            code = codes.pop()
            if code is None:
                continue
            for name in code.co_names:
                used = scope.get(name)
                if isinstance(used, types.ModuleType):  # `helpers.make()`: the module itself, if local
                    if not used.__name__.startswith("workbench") and not _is_installed(used.__name__):
                        found.add(used.__name__)
                elif callable(used):
                    todo.append(used)
            codes += [const for const in code.co_consts if hasattr(const, "co_names")]  # nested functions, lambdas
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                todo += [cell.cell_contents] if callable(cell.cell_contents) else []
            except ValueError:  # an empty cell
                pass
    return found


def portable(value: Any) -> bytes:
    """Pickle ``value`` for the engines; code from modules they may not have travels by value."""
    import cloudpickle
    import keras

    def keras_portable(item):
        if isinstance(item, keras.optimizers.Optimizer):
            return keras.optimizers.deserialize, keras.optimizers.serialize(item)
        if isinstance(item, keras.losses.Loss):
            return keras.losses.deserialize, keras.losses.serialize(item)
        if isinstance(item, keras.Model):
            try:
                return keras.models.model_from_json, item.to_json()
            except Exception:  # noqa: BLE001 - subclassed models have no config
                raise ConfigurationError(
                    f"cannot send {type(item).__name__} to the engines: pass a function that builds the model instead, "
                    "e.g. model=make_model.") from None
        return None

    items = value if isinstance(value, tuple) else (value,)
    shipped = tuple(("rebuild", *keras_portable(i)) if keras_portable(i) else ("as-is", i) for i in items)
    by_value = [sys.modules[m] for m in _local_modules(items) if m in sys.modules]
    for module in by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(shipped)
    finally:
        for module in by_value:
            cloudpickle.unregister_pickle_by_value(module)


class WorkerGroup:
    """A cluster's worker engines, called together, with the all-reduce group formed on them."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.client = cluster.client
        self.workers = [r for r in cluster.tasks if r.job == "worker"]
        self.engines = [r.engine_id for r in self.workers]

    def name(self, engine_id: int) -> str:
        return next(r.name for r in self.workers if r.engine_id == engine_id)

    def call_all(self, calls: dict[int, tuple], what: str, timeout: float, check=None) -> dict[int, Any]:
        """Run ``{engine: (function, *args)}`` on the worker engines at once; results by engine.

        ``check()`` runs while waiting, and may raise to stop waiting (the calls are then left to fail).
        """
        return self.wait(self.send(calls), what, timeout, check)

    def send(self, calls: dict[int, tuple]) -> dict:
        """Send ``{engine: (function, *args)}`` to the worker engines (each runs it after what it was sent before)."""
        return start_on_engines(self.client, calls)

    def wait(self, sent: dict, what: str, timeout: float, check=None) -> dict[int, Any]:
        """The results of calls ``send`` sent, by engine, within ``timeout`` seconds from now (see ``call_all``)."""
        try:
            return await_engines(sent, Deadline(timeout), on_progress=(lambda _done, _total: check()) if check else None)
        except RemoteCallFailed as exc:
            raise TrainingError(f"{self.name(exc.engine)} failed while {what}: {exc.reason}") from None
        except RemoteCallsTimedOut as exc:
            raise TrainingError(
                f"{', '.join(self.name(e) for e in exc.pending)} did not finish {what} within {timeout:.0f} s (a worker is "
                "stalled or gone, and the others wait for it in the all-reduce). Check cluster.status(); restart the "
                "cluster and resume from the last checkpoint.") from None

    def _reserve_addresses(self, attempts: int = 5) -> list[str]:
        """A free port on each worker's host, distinct per host: engines that reserve at the same moment on one
        host can be handed the same ephemeral port (both then bind it, and one server fails to start)."""
        for _ in range(attempts):
            ports = self.call_all({e: (engine_side.reserve_port,) for e in self.engines}, "reserving all-reduce ports", 30)
            addresses = [f"{r.address.rpartition(':')[0]}:{ports[r.engine_id]}" for r in self.workers]
            if len(set(addresses)) == len(addresses):
                return addresses
        raise ClusterStateError(f"the workers were handed the same port {attempts} times in a row ({', '.join(addresses)}): "
                                "the host is short of free ports. Free some (stop other clusters), then train again.")

    @property
    def key(self) -> list[str]:
        """The group is these TF tasks in these processes, whatever ports it uses."""
        return [f"{r.address} pid {r.pid}" for r in self.workers]

    def stale(self) -> list[str]:
        """Workers whose engine joined a group with other members (one was re-hosted, or the workers were scaled)
        since: TensorFlow cannot change a process's group, and a new member waits forever for them."""
        keys = self.call_all({e: (allreduce_engine.group_key,) for e in self.engines}, "reading the all-reduce groups", 30)
        return [self.name(e) for e, key in keys.items() if key is not None and key != self.key]

    def form(self) -> str | None:
        """Join every worker engine to one MultiWorkerMirroredStrategy (reused if already formed); the job whose
        program every worker keeps (``engine._PROGRAM``), None where they differ or keep none."""
        addresses = self._reserve_addresses()
        key = self.key
        joined = self.call_all({e: (allreduce_engine.join_group, addresses, i, key) for i, e in enumerate(self.engines)},
                               "forming the all-reduce group", GROUP_TIMEOUT)
        refused = [(self.name(e), r["error"]) for e, r in joined.items() if not r["ok"]]
        if refused:
            raise ClusterStateError(
                f"{', '.join(n for n, _ in refused)} cannot join an all-reduce group over "
                f"{', '.join(r.name for r in self.workers)}: {refused[0][1]}. The worker set changed since the cluster's "
                "first all-reduce; restart the cluster (cluster.stop(); cluster.start()) to all-reduce over the current workers.")
        programs = {r.get("program") for r in joined.values()}
        return programs.pop() if len(programs) == 1 else None
