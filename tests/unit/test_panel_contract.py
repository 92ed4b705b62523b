"""The panel's TypeScript types are generated from the Python dataclasses; the committed file must match."""

import dataclasses
from pathlib import Path

import pytest

from workbench.server import models, typescript

MODELS_TS = Path(__file__).resolve().parents[2] / "extension" / "src" / "models.ts"


def test_the_committed_typescript_models_are_generated_from_python():
    assert MODELS_TS.read_text() == typescript.render(), (
        "extension/src/models.ts is stale: run `python -m workbench.server.typescript > extension/src/models.ts`")


@pytest.mark.parametrize("cls", typescript.EXPORTED)
def test_every_field_of_every_shape_is_in_the_typescript(cls):
    text = MODELS_TS.read_text()
    block = text.split(f"export interface I{cls.__name__} {{", 1)[1].split("}", 1)[0]
    assert [line.split(":")[0].strip().rstrip("?") for line in block.strip().splitlines()] == [
        f.name for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("annotation, ts", [
    ("str", "string"), ("list[str]", "string[]"), ("dict[str, list[str]]", "Record<string, string[]>"),
    ("float | None", "number | null"), ("list[TaskInfo]", "ITaskInfo[]"), ("dict[str, WorkerRates]", "Record<string, IWorkerRates>"),
])
def test_annotations_translate(annotation, ts):
    assert typescript.ts_type(annotation) == ts


def test_a_summary_that_drifted_from_jobnow_is_refused():
    good = {f.name: 0 for f in dataclasses.fields(models.JobNow)} | {"notes": [], "workers": {}, "eta_s": None}
    assert models.JobNow.from_json(good).to_json() == good
    with pytest.raises(TypeError, match="differ from JobNow"):
        models.JobNow.from_json({**good, "extra": 1})
    with pytest.raises(TypeError, match="differ from JobNow"):
        models.JobNow.from_json({k: v for k, v in good.items() if k != "steps_done"})


def test_a_summary_from_an_older_owner_lacks_only_the_newer_fields():
    good = {f.name: 0 for f in dataclasses.fields(models.JobNow)} | {"notes": [], "workers": {}, "eta_s": None}
    older = {k: v for k, v in good.items() if k not in ("transfer", "bytes_per_step")}
    assert models.JobNow.from_json(older).bytes_per_step == 0
