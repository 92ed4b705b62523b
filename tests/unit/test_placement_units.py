"""Pure parts of placement: layouts, variable paths, the ps placer's choice, tables, payloads for engines."""

import keras
import pytest

import workbench as wb
from workbench.tables import html_table, text_table
from workbench.training.modelling.placement import PsPlacer, task_of
from workbench.training.placing import _device_for_path, resolve_layout
from workbench.training.strategies.allreduce.engine import unpack
from workbench.training.strategies.allreduce.group import portable

PS0, PS1 = "/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0"


def test_unlisted_layers_follow_the_layer_before_them():
    layers = ["input", "embed", "hidden", "dropout", "logits"]
    assert resolve_layout(layers, {"hidden": "worker:0", "logits": "worker:1"}) == {
        "input": "worker:0", "embed": "worker:0", "hidden": "worker:0", "dropout": "worker:0", "logits": "worker:1"}


@pytest.mark.parametrize("layout, match", [
    ({}, "pass the placement as a dict"),
    (["hidden"], "pass the placement as a dict"),
    ({"hiden": "worker:0"}, "no layer.*'hiden'.*its layers are input, hidden"),
])
def test_bad_layouts_say_what_to_pass(layout, match):
    with pytest.raises(wb.ConfigurationError, match=match):
        resolve_layout(["input", "hidden"], layout)


def test_variable_paths_map_to_the_innermost_named_layer():
    devices = {"encoder": "/job:worker/task:0", "dense": "/job:worker/task:1"}
    assert _device_for_path("model/encoder/dense", devices, "default") == "/job:worker/task:1"
    assert _device_for_path("model/encoder", devices, "default") == "/job:worker/task:0"
    assert _device_for_path("model/other", devices, "default") == "default"
    assert task_of(PS1) == "ps:1" and task_of("") == "-"


def test_ps_placer_spreads_by_bytes_but_keeps_a_requested_ps():
    placer = PsPlacer([PS0, PS1])
    assert placer.choose(1000) == PS0
    assert placer.choose(10) == PS1
    assert placer.choose(10) == PS1  # ps:1 still lighter
    assert placer.choose(5000, requested=PS0) == PS0  # e.g. an optimizer slot beside its variable
    assert placer.choose(1, requested="/job:worker/replica:0/task:0/device:CPU:0") == PS1  # not a ps: greedy
    assert dict(placer.loads) == {PS0: 6000, PS1: 21}


def test_only_variables_at_the_threshold_with_enough_rows_are_partitioned():
    placer = PsPlacer([PS0, PS1, "/job:ps/replica:0/task:2/device:CPU:0"], partition_bytes=1000)
    assert placer.shard_rows((10, 25), 1000) == [4, 3, 3]
    assert placer.shard_rows((10, 25), 999) is None  # below the threshold
    assert placer.shard_rows((2, 1000), 8000) == [1, 1]  # no more shards than rows
    assert placer.shard_rows((), 8000) is None and placer.shard_rows((1, 5000), 20000) is None
    assert PsPlacer([PS0], partition_bytes=1).shard_rows((10, 10), 400) is None  # one ps: nothing to split over
    assert PsPlacer([PS0, PS1]).shard_rows((10, 10), 10**9) is None  # partition_bytes=0: never


def test_tables_pad_columns_and_escape_html():
    text = text_table(("a", "long column"), [("x", "1"), ("yyyy", "<b>")], title="T")
    assert text.splitlines() == ["T", "a     long column", "----  -----------", "x     1", "yyyy  <b>"]
    assert "&lt;b&gt;" in html_table(("a",), [("<b>",)])


def local_function(x):
    return x + 1


def test_payloads_for_engines_rebuild_keras_objects_and_carry_local_functions_by_value():
    optimizer = keras.optimizers.Adam(0.02)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="out")])
    rebuilt_optimizer, rebuilt_loss, rebuilt_model, function, name = unpack(portable((optimizer, loss, model, local_function, "mse")))
    assert isinstance(rebuilt_optimizer, keras.optimizers.Adam) and rebuilt_optimizer.get_config()["learning_rate"] == pytest.approx(0.02)
    assert rebuilt_loss.get_config()["from_logits"] is True
    assert [layer.name for layer in rebuilt_model.layers] == ["out"]
    assert function(1) == 2 and name == "mse"
    # this test module is not importable elsewhere: its function travels by value and runs in a fresh Python
    import subprocess
    import sys

    script = "import sys; from workbench.training.strategies.allreduce.engine import unpack; print(unpack(sys.stdin.buffer.read())[0](41))"
    result = subprocess.run([sys.executable, "-c", script], input=portable(local_function), capture_output=True, cwd="/", timeout=60)
    assert result.stdout.strip() == b"42", result.stderr[-2000:]


def test_a_function_using_helpers_from_a_local_module_travels_with_them(tmp_path, monkeypatch):
    # a notebook's function that calls a helper from a module beside the notebook, imported by name or as a module:
    # the engines cannot import that module, so it travels by value too
    import subprocess
    import sys
    import textwrap

    (tmp_path / "wb_local_helpers.py").write_text(textwrap.dedent("""\
        OFFSET = 1

        def double(x):
            return 2 * x + OFFSET - 1
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import wb_local_helpers
    from wb_local_helpers import double

    def by_name(x):
        return double(x) + 1

    def by_module(x):
        return (lambda y: wb_local_helpers.double(y))(x) + 2  # through a nested function too

    script = ("import sys; from workbench.training.strategies.allreduce.engine import unpack; "
              "f, g = unpack(sys.stdin.buffer.read()); print(f(20), g(20))")
    result = subprocess.run([sys.executable, "-c", script], input=portable((by_name, by_module)), capture_output=True,
                            cwd="/", timeout=60)
    assert result.stdout.split() == [b"41", b"42"], result.stderr[-2000:]


def test_placement_diagram_puts_layers_in_task_columns_and_marks_crossings():
    from workbench.training.placing import Placement, PlacementRow, diagram_layout, diagram_svg

    layers = [("embed", ["ps:0", "ps:1"]), ("hidden", ["worker:0"]), ("out", ["worker:0"]), ("logits", ["worker:1"])]
    layout = diagram_layout(layers)
    assert [t for t, _x in layout["columns"]] == ["ps:0", "ps:1", "worker:0", "worker:1"]
    assert [(b["layer"], b["task"]) for b in layout["boxes"]] == [
        ("embed", "ps:0"), ("embed", "ps:1"), ("hidden", "worker:0"), ("out", "worker:0"), ("logits", "worker:1")]
    assert [e["crosses"] for e in layout["edges"]] == [True, True, False, True]
    svg = diagram_svg(layers)
    assert svg.startswith("<svg") and svg.count("<rect") == 5 and "stroke-dasharray" in svg and "<script" not in svg
    rows = [PlacementRow("hidden", "kernel", "64x32", "worker:0", "/job:worker/task:0"),
            PlacementRow("hidden", "bias", "32", "worker:0", "/job:worker/task:0"),
            PlacementRow("logits", "kernel", "32x10", "worker:1", "/job:worker/task:1")]
    placement = Placement(rows)
    assert placement.layer_tasks() == [("hidden", ["worker:0"]), ("logits", ["worker:1"])]
    assert placement.flow() == "hidden [worker:0] => logits [worker:1]"
    assert str(placement).endswith("hidden [worker:0] => logits [worker:1]")
    assert "<svg" in placement._repr_html_()
