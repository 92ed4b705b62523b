"""Step functions shared by the ps jobs (async-ps, sync-ps) of one connection that train the same program.

A job's step function is traced in the kernel when its first call starts (about 0.5 s for the digits MLP) and set
up on every task it reaches at that call (another 0.3-0.4 s): most of a short job's set-up. A notebook trains the
same model again and again (a cell re-run, a sweep over seeds or learning rates), and each of those jobs traced and
set up the same function, on variables of its own.

So the step function takes every variable it touches as an argument: TensorFlow resolves a variable that the
traced code reaches through Python (the model's layers, the optimizer's slots) to the argument that holds it, and the
graph captures nothing. A later job whose program is the same (``program_key``: the model's layers and config, the
loss, the metrics, the optimizer's class and config but its learning rate, each variable's shape, dtype and device,
how the step reads and pushes) calls the function already traced and set up, with its own variables. While it
traces, Python reaches the running job's objects (``Shared.current``). A trace that captured a variable all the same
(a layer reading a ``tf.Variable`` Keras does not track) is never shared: the job that traced it keeps it.

The functions live as long as the kernel's connection: ``StepCache`` is a holder of the connection
(``cluster.process.connection``) and lets them go when the kernel connects elsewhere or the cluster stops; at most
``KEPT`` programs at a time.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from .placement import shards_of

KEPT = 4  # programs whose step functions are kept at a time


class Shared:
    """One program's step functions (``functions``), the job whose objects their traces reach (``current``) and
    the job that traced them (``owner``)."""

    def __init__(self, key: tuple | None):
        self.key = key
        self.current: Any = None  # what the functions' Python reaches while they trace: the job calling them now
        self.functions: Any = None  # async-ps: ``steps_in_one_call``'s; sync-ps: the barrier's (work, aggregate)
        self.owner: Any = None  # who traced them (``StepFunctions.owner``: the job's name)
        self.private = key is None  # never handed to another job
        self._taken_at = 0  # their traces when ``current`` took them

    def tracing_count(self) -> int:
        """Traces of all its functions."""
        functions = self.functions if isinstance(self.functions, tuple) else (self.functions,)
        return sum(f.experimental_get_tracing_count() for f in functions if f is not None)

    def leave(self, current) -> int:
        """``current`` calls the functions no more (a later job of the program may): the traces it made since it
        took them; 0 where it did not hold them."""
        if self.current is not current:
            return 0
        self.current = None  # the kept functions do not keep that job's objects alive
        return self.tracing_count() - self._taken_at

    def reused_by(self, job) -> bool:
        """Whether ``job`` calls functions another job traced."""
        return self.owner is not None and self.owner != job


class StepCache:
    """The shared step functions of this kernel's connection, by program."""

    def __init__(self):
        self._entries: OrderedDict[tuple, Shared] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, key: tuple | None, current, owner) -> tuple[Shared, bool]:
        """The program's shared functions with ``current`` as what their traces reach, and whether they exist
        already; new ones (``owner``: the job that will trace them) are kept for later jobs, and the cache becomes a
        holder of the current connection (whichever trainer connected), which lets go of them with it."""
        from ...cluster.process import connection

        shared, found = self._take(key, current, owner)
        if not found and not shared.private:
            connection.hold(self)
        return shared, found

    def _take(self, key: tuple | None, current, owner) -> tuple[Shared, bool]:
        with self._lock:
            shared = self._entries.get(key) if key is not None else None
            if shared is not None and shared.current is not None and shared.current is not current:
                shared = None  # another job calls them now, and a trace would reach its objects: a private one
                key = None
            if shared is not None:
                self._entries.move_to_end(key)
                shared.current, shared._taken_at = current, shared.tracing_count()
                return shared, True
            shared = Shared(key)
            shared.current, shared.owner = current, owner
            if key is not None:
                self._entries[key] = shared
                while len(self._entries) > KEPT:
                    self._entries.popitem(last=False)
            return shared, False

    def make_private(self, shared: Shared) -> None:
        """``shared``'s trace captured state of its own job: no other job gets it."""
        with self._lock:
            shared.private = True
            if shared.key is not None and self._entries.get(shared.key) is shared:
                del self._entries[shared.key]

    def __len__(self) -> int:
        return len(self._entries)

    # -- a holder of the kernel's connection ---------------------------------------------------

    def settle(self, timeout: float) -> str | None:
        return None  # nothing runs in it

    def release_remote(self) -> None:
        """The kernel connects elsewhere, or the cluster stops: the functions set up on its tasks go."""
        with self._lock:
            self._entries.clear()


CACHE = StepCache()


def job_variables(fns) -> list:
    """Every ``tf.Variable`` a job's step reaches: the model's (trainable or not) and the optimizer's, shards of
    partitioned ones one by one, each once."""
    seen, found = set(), []
    for variable in [*fns.model.variables, *fns.optimizer.variables]:
        for shard in shards_of(variable):
            if id(shard) not in seen:
                seen.add(id(shard))
                found.append(shard)
    return found


def program_key(fns, variables: list, settings: tuple) -> tuple | None:
    """What decides a job's step function besides its variables' values, or None where that cannot be told."""
    try:
        config = fns.model.get_config()
        model = json.dumps(_without_names(config, _layer_names(fns.model, config)), sort_keys=True, default=repr)
        optimizer = json.dumps(_optimizer_settings(fns.optimizer), sort_keys=True, default=repr)
    except Exception:  # noqa: BLE001 - a model or optimizer without a full config: its functions stay its own
        return None
    loss = _callable_key(fns.loss_fn)
    metrics = tuple((name, _callable_key(fn)) for name, fn in fns.metric_fns.items())
    if loss is None or any(key is None for _, key in metrics):
        return None
    layout = tuple((tuple(v.shape.as_list()), v.dtype.name, v.device, bool(v.trainable)) for v in variables)
    packing = None if fns.packing is None else (fns.packing.transfer, len(fns.packing.groups), tuple(fns.packing.loose))
    return (type(fns.model), _layer_classes(fns.model), model, type(fns.optimizer), optimizer, loss, metrics,
            layout, tuple(map(str, fns.splits or ())), packing, settings)


def _optimizer_settings(optimizer) -> dict:
    """The optimizer's config as far as it shapes the step: not its name (Keras names each one apart, as layers),
    nor a learning rate held in one of its variables (Keras keeps a number there: an argument of the step, like
    the weights), so that a sweep over learning rates shares one function; a schedule stays."""
    config = {key: value for key, value in optimizer.get_config().items() if key != "name"}
    held = any(getattr(v, "path", "").endswith("learning_rate") for v in optimizer.variables)
    if held and isinstance(config.get("learning_rate"), (int, float)):
        del config["learning_rate"]
    return config


def _layer_names(layer, config: Any) -> dict[str, str]:
    """Each name of ``layer`` and the layers inside it (those its config lists too: a ``Sequential``'s input
    layer), and its place among them: Keras names every new layer apart (``dense_3`` in the next job), which says
    nothing about the program."""
    names = [layer.name]
    stack = list(getattr(layer, "layers", None) or [])
    while stack:
        sub = stack.pop(0)
        names.append(sub.name)
        stack.extend(getattr(sub, "layers", None) or [])
    listed = [config]
    while listed:
        entry = listed.pop(0)
        if isinstance(entry, dict):
            layers = entry.get("layers")
            for sub in layers if isinstance(layers, list) else []:
                name = sub.get("config", {}).get("name") if isinstance(sub, dict) else None
                if isinstance(name, str):
                    names.append(name)
            listed.extend(entry.values())
        elif isinstance(entry, list):
            listed.extend(entry)
    return {name: f"<layer {index}>" for index, name in enumerate(dict.fromkeys(names))}


def _without_names(config: Any, names: dict[str, str]) -> Any:
    """``config`` with every layer name replaced by its place (``_layer_names``), connections kept."""
    if isinstance(config, dict):
        return {key: _without_names(value, names) for key, value in config.items()}
    if isinstance(config, (list, tuple)):
        return [_without_names(value, names) for value in config]
    return names.get(config, config) if isinstance(config, str) else config


def _layer_classes(layer) -> tuple:
    """The classes of ``layer`` and of every layer inside it: a class defined again (a notebook cell run again)
    is another program, whatever its config says."""
    inner = getattr(layer, "layers", None) or []
    return (type(layer), *(cls for sub in inner for cls in _layer_classes(sub)))


def _callable_key(fn) -> Any:
    """A loss or metric as a key: a Keras object by its class and config, a function by itself; else None."""
    get_config = getattr(fn, "get_config", None)
    if get_config is not None and not isinstance(fn, type):
        try:
            return type(fn), json.dumps(get_config(), sort_keys=True, default=repr)
        except Exception:  # noqa: BLE001 - no config: by identity below, if it can be
            pass
    try:
        hash(fn)
    except TypeError:
        return None
    return fn


def call(shared: Shared, function, args: tuple, captured) -> Any:
    """``function(*args)``, one of ``shared``'s; a new trace for which ``captured(*args)`` lists a resource of the
    calling job (where every one should be an argument) keeps the functions to that job."""
    traces = function.experimental_get_tracing_count()
    outputs = function(*args)
    if not shared.private and function.experimental_get_tracing_count() != traces and captured(*args):
        CACHE.make_private(shared)
    return outputs


def captured_resources(concrete) -> list:
    """The resource tensors a traced function captured (state of one job, where none should be)."""
    import tensorflow as tf

    return [t for t in concrete.captured_inputs if t.dtype == tf.resource]
