"""Model parallelism: a model's layers on chosen tasks, each layer's backward pass on its own task.

``wb.place(model, {"hidden": "worker:0", "logits": "worker:1"})`` builds the model with each
layer's variables on its task and runs each layer's forward ops there. Training differentiates
with ``colocate_gradients_with_ops``, so every gradient op runs where its forward op ran (TF2's
tape would put the whole backward pass on the caller's device instead, moving every activation
back). ``wb.placement(...)`` lists where each variable lives and where each layer's forward and
backward ops run.
"""

from __future__ import annotations

import functools
import html
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..cluster.process import connection
from ..compat import keras as keras_compat
from ..errors import ConfigurationError
from ..tables import html_table, text_table
from .modelling.placement import task_of, variable_devices


def resolve_layout(layer_names: list[str], layout: dict[str, str]) -> dict[str, str]:
    """Each layer's task: as listed, or the task of the layer before it (the first listed for leading layers)."""
    if not isinstance(layout, dict) or not layout:
        raise ConfigurationError(
            "pass the placement as a dict of layer name -> task, e.g. {'hidden': 'worker:0', 'logits': 'worker:1'}.")
    unknown = [name for name in layout if name not in layer_names]
    if unknown:
        raise ConfigurationError(
            f"the model has no layer(s) {', '.join(map(repr, unknown))}: its layers are {', '.join(layer_names)}. "
            "Name layers when you build them (keras.layers.Dense(32, name='hidden')) to place them by name.")
    current = next(layout[name] for name in layer_names if name in layout)
    resolved = {}
    for name in layer_names:
        current = layout.get(name, current)
        resolved[name] = current
    return resolved


def _device_for_path(path: str, layer_devices: dict[str, str], default: str) -> str:
    """The device of the innermost layer named in a Keras variable path like ``model/hidden``."""
    for part in reversed(path.split("/")):
        if part in layer_devices:
            return layer_devices[part]
    return default


def _on_device(call: Callable, device: str) -> Callable:
    import tensorflow as tf

    @functools.wraps(call)
    def placed_call(*args, **kwargs):
        with tf.device(device):
            return call(*args, **kwargs)

    return placed_call


@dataclass
class PlacementRow:
    layer: str
    variable: str
    shape: str
    task: str
    device: str


class Placement:
    """What ``wb.placement`` returns: one row per variable (and per weightless layer); a table when printed."""

    COLUMNS = ("layer", "variable", "shape", "task", "device", "backward on")

    def __init__(self, rows: list[PlacementRow], backward: dict[str, list[str]] | None = None):
        self.rows = rows
        self.backward = backward or {}

    def _cells(self) -> list[tuple[str, ...]]:
        return [(r.layer, r.variable, r.shape, r.task, r.device, ", ".join(self.backward.get(r.layer, [])) or "-")
                for r in self.rows]

    def by_layer(self) -> dict[str, str]:
        """``{layer: task}`` for every layer with variables."""
        return {r.layer: r.task for r in self.rows if r.variable != "-"}

    def layer_tasks(self) -> list[tuple[str, list[str]]]:
        """Layers in model order, each with the task(s) holding its variables."""
        found: dict[str, list[str]] = {}
        for row in self.rows:
            tasks = found.setdefault(row.layer, [])
            tasks.extend(t for t in row.task.split(", ") if t not in tasks)
        return list(found.items())

    def flow(self) -> str:
        """One line: the layers in order with their tasks; ``=>`` where activations cross tasks."""
        parts, previous = [], None
        for layer, tasks in self.layer_tasks():
            arrow = "" if previous is None else (" -> " if tasks == previous else " => ")
            parts.append(f"{arrow}{layer} [{', '.join(tasks)}]")
            previous = tasks
        return "".join(parts)

    def __str__(self) -> str:
        return text_table(self.COLUMNS, self._cells()) + "\n" + self.flow()

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return html_table(self.COLUMNS, self._cells(), css_class="workbench-placement") + diagram_svg(self.layer_tasks())


def diagram_layout(layers: list[tuple[str, list[str]]], box=(120, 26), gap=(40, 14)) -> dict:
    """Pure geometry of the placement diagram: one column per task, one row per layer.

    Returns ``columns`` (task, x), ``boxes`` (layer, task, x, y, w, h) and ``edges`` between
    consecutive layers' boxes, with ``crosses`` set where the activations move between tasks.
    """
    tasks: list[str] = []
    for _layer, layer_tasks in layers:
        tasks.extend(t for t in layer_tasks if t not in tasks)
    width, height = box
    column_x = {task: 10 + i * (width + gap[0]) for i, task in enumerate(tasks)}
    boxes, edges, previous = [], [], []
    for row, (layer, layer_tasks) in enumerate(layers):
        y = 30 + row * (height + gap[1])
        current = [dict(layer=layer, task=t, x=column_x[t], y=y, w=width, h=height) for t in layer_tasks]
        for a in previous:
            for b in current:
                edges.append(dict(x1=a["x"] + width / 2, y1=a["y"] + height, x2=b["x"] + width / 2, y2=b["y"],
                                  crosses=a["task"] != b["task"]))
        boxes.extend(current)
        previous = current
    size = (10 + len(tasks) * (width + gap[0]), 30 + len(layers) * (height + gap[1]))
    return {"columns": [(t, column_x[t]) for t in tasks], "boxes": boxes, "edges": edges, "size": size}


def diagram_svg(layers: list[tuple[str, list[str]]]) -> str:
    """The placement diagram as inline SVG (no scripts, no external resources)."""
    if not layers:
        return ""
    layout = diagram_layout(layers)
    width, height = layout["size"]
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' class='workbench-placement-diagram' width='{width}' height='{height}' "
             "font-family='sans-serif' font-size='11'>"]
    for task, x in layout["columns"]:
        parts.append(f"<text x='{x + 60}' y='16' text-anchor='middle' font-weight='bold'>{html.escape(task)}</text>")
    for e in layout["edges"]:
        style = "stroke='#c62828' stroke-dasharray='4 2'" if e["crosses"] else "stroke='#555'"
        parts.append(f"<line x1='{e['x1']}' y1='{e['y1']}' x2='{e['x2']}' y2='{e['y2']}' {style}/>")
    for b in layout["boxes"]:
        parts.append(f"<rect x='{b['x']}' y='{b['y']}' width='{b['w']}' height='{b['h']}' rx='4' fill='#e3f2fd' stroke='#1565c0'/>"
                     f"<text x='{b['x'] + b['w'] / 2}' y='{b['y'] + 17}' text-anchor='middle'>{html.escape(b['layer'])}</text>")
    parts.append("</svg>")
    return "".join(parts)


def _layer_rows(model) -> list[PlacementRow]:
    rows = []
    for layer in model.layers:
        weights = layer.weights
        if not weights:
            continue
        for weight in weights:
            devices = variable_devices(weight)  # several for a partitioned variable
            rows.append(PlacementRow(layer.name, weight.name, "x".join(map(str, weight.shape)) or "scalar",
                                     ", ".join(task_of(d) for d in devices), ", ".join(devices)))
    return rows


class PlacedModel:
    """A Keras model whose layers live on chosen tasks of a cluster. Made by ``wb.place``.

    ``wb.train`` trains it model-parallel (``placed``: it tells a placed model from a model function
    without importing this module, which imports ``wb.train``).

    ``train(data, loss, ...)`` trains it (input pipeline on the first layer's task, loss on the last
    layer's task, each gradient with its forward op) and returns a ``Job``; ``model`` is the placed
    Keras model itself, usable in ``cluster.device`` scopes and in a ``tf.function``.
    """

    placed = True

    def __init__(self, cluster, source: Any, model, layer_tasks: dict[str, str], layer_devices: dict[str, str]):
        self.cluster = cluster
        self.model = model
        self.layer_tasks = layer_tasks
        self.layer_devices = layer_devices
        self.source = source  # what wb.place was given (a model function, or a model to clone)
        self._epoch = connection.current_epoch()

    @property
    def input_device(self) -> str:
        return next(iter(self.layer_devices.values()))

    @property
    def output_device(self) -> str:
        return list(self.layer_devices.values())[-1]

    def check_connection(self) -> None:
        """Raise if the kernel's connection changed since the model was placed (its variables are gone)."""
        connection.check_epoch(self._epoch, "this placed model")

    def __call__(self, *args, **kwargs):
        self.check_connection()
        return self.model(*args, **kwargs)

    def backward_devices(self, loss: Any = "mse") -> dict[str, list[str]]:
        """Where each layer's gradient ops run: traced, not run (``{layer: [devices]}``)."""
        import tensorflow as tf

        from .modelling.losses import resolve_loss
        from .modelling.steps import StepFunctions

        inputs = self.model.inputs[0]
        outputs = self.model.outputs[0]
        fns = StepFunctions(self.model, None, resolve_loss(loss), {})
        x_spec = tf.TensorSpec([2, *inputs.shape[1:]], inputs.dtype)
        y_spec = tf.TensorSpec([2, *outputs.shape[1:]], "float32")
        graph = tf.function(lambda x, y: fns.placed_gradients(x, y, self.output_device)[2]).get_concrete_function(x_spec, y_spec).graph
        found: dict[str, set] = {}
        for op in graph.get_operations():
            if not op.name.startswith("gradients/") or op.type in ("Identity", "NoOp", "Const"):
                continue
            # graph name scopes are made unique: layer "hidden" may trace as "hidden_1"
            parts = [re.sub(r"_\d+$", "", part) for part in op.name.split("/")] + op.name.split("/")
            layer = next((part for part in reversed(parts) if part in self.layer_devices), None)
            if layer is not None and op.device:
                found.setdefault(layer, set()).add(op.device)
        return {layer: sorted(devices) for layer, devices in found.items()}

    def place_again(self) -> None:
        """Place the model again on the same tasks (after one of them was re-hosted); ``model`` is then the new one."""
        again = place(self.source, self.layer_tasks, cluster=self.cluster)
        self.model, self._epoch = again.model, again._epoch

    def train(self, data: Callable, loss: Any = None, optimizer: Any = None, **kwargs):
        """Train the placed model: ``wb.train(cluster, placed, data, loss, optimizer, ...)`` (model parallel;
        ``strategy=wb.ModelParallel(steps_per_call=...)`` to set its option)."""
        from .api import train

        return train(self.cluster, self, data, loss, optimizer, **kwargs)

    def __repr__(self) -> str:
        layout = ", ".join(f"{layer}: {task}" for layer, task in self.layer_tasks.items())
        return f"<workbench.PlacedModel {self.model.name} on {self.cluster.name!r}: {layout}>"


def place(model: Any, layout: dict[str, str], *, cluster=None) -> PlacedModel:
    """Build ``model`` with its layers on the tasks named in ``layout``; return a ``PlacedModel``.

    ``model`` is a function returning a functional or Sequential ``keras.Model`` (or such a
    model, which is cloned). ``layout`` maps layer names to tasks (``"worker:1"``) or full device
    names (``"/job:worker/replica:0/task:1/device:GPU:0"``); unlisted layers stay on the task of
    the layer before them. ``cluster`` defaults to the cluster this kernel is connected to
    (``cluster.connect()``).
    """
    import keras
    import tensorflow as tf

    cluster = cluster or connection.current_cluster()
    if cluster is None:
        raise ConfigurationError("wb.place needs a cluster: call cluster.connect() first, or pass cluster=.")
    cluster.job_queue.require_idle("place a model")
    connection.connect(cluster)
    if isinstance(model, keras.Model):
        local = model
    elif callable(model):
        with tf.device("/job:localhost/replica:0/task:0/device:CPU:0"):
            local = model()
        if not isinstance(local, keras.Model):
            raise ConfigurationError(f"the model function returned {type(local).__name__}, not a keras.Model.")
    else:
        raise ConfigurationError(f"model={model!r}: pass a function that builds a keras.Model (or a keras.Model).")
    layer_names = [layer.name for layer in local.layers]
    layer_tasks = resolve_layout(layer_names, layout)
    layer_devices = {name: _device_name(cluster, task) for name, task in layer_tasks.items()}
    default = next(iter(layer_devices.values()))

    def creator(next_creator, **kwargs):
        with tf.device(_device_for_path(keras_compat.current_layer_path(), layer_devices, default)):
            return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        try:
            placed = keras.models.clone_model(local)
        except Exception as exc:  # noqa: BLE001 - subclassed models cannot be cloned layer by layer
            raise ConfigurationError(
                f"cannot place {type(local).__name__} layer by layer ({exc}); build it with the functional API or "
                "keras.Sequential.") from None
    placed.set_weights(local.get_weights())
    for layer in placed.layers:
        if layer.name in layer_devices:
            layer.call = _on_device(layer.call, layer_devices[layer.name])
    return PlacedModel(cluster, model, placed, layer_tasks, layer_devices)


def _device_name(cluster, task: str) -> str:
    if task.startswith("/job:"):
        return task
    return f"{cluster.task(task).task.device}/device:CPU:0"


def placement(target: Any) -> Placement:
    """Where each variable of ``target`` lives (and, for a placed model, where each layer's backward runs).

    ``target``: a ``PlacedModel``, a ``Job`` (its variables on the cluster), or a ``keras.Model``.
    """
    import keras

    from .job.job import Job

    if isinstance(target, PlacedModel):
        return Placement(_layer_rows(target.model), target.backward_devices())
    if isinstance(target, Job):
        model = target.trainer.model_on_tasks()
        if model is None:
            raise ConfigurationError("this job's variables live on the worker engines (allreduce): every worker holds a copy.")
        return Placement(_layer_rows(model))
    if isinstance(target, keras.Model):
        return Placement(_layer_rows(target))
    raise ConfigurationError(f"wb.placement({type(target).__name__}): pass a placed model (wb.place), a Job or a keras.Model.")
