"""MLflow's own UI comparing two jobs of tutorial 03's strategies, each tracked with ``wb.tracking.MLflow``.

The screenshot goes to test-artifacts/tracking-compare.png (and, under ``make screenshots``, to docs/_static/,
where the tracking guide takes it from). What is asserted: the comparison page of a real tracking server
names both jobs' runs and their strategies, and a per-worker series of each job is there to plot.
"""

import json
import os
import shutil
import urllib.parse

import keras
import pytest
from conftest import ARTIFACTS, ROOT
from mlflow import MlflowClient
from training_helpers import LOSS, make_model

import workbench as wb

pytestmark = [pytest.mark.cluster, pytest.mark.browser]


def test_mlflow_compares_an_async_and_a_sync_job(cluster, mlflow_experiment, mlflow_server, page):
    runs = []
    for strategy in (wb.AsyncPS(), wb.SyncPS()):
        tracker = wb.tracking.MLflow()
        wb.train(cluster, make_model, wb.datasets.digits, LOSS, keras.optimizers.Adam(0.01), metrics=["accuracy"],
                 strategy=strategy, epochs=4, steps_per_epoch=50, seed=7, validation_data=wb.datasets.digits_test,
                 callbacks=[tracker]).wait(300)
        runs.append(tracker.run_id)
    client = MlflowClient()
    names = {client.get_run(r).info.run_name for r in runs}
    assert {n.split("-")[0] for n in names} == {"async", "sync"}
    for run in runs:
        assert client.get_metric_history(run, "examples_per_second/worker-0")

    query = urllib.parse.urlencode({"runs": json.dumps(runs), "experiments": json.dumps([mlflow_experiment.experiment_id])})
    page.goto(f"{mlflow_server}/#/compare-runs?{query}", wait_until="domcontentloaded")
    for name in names:
        page.get_by_text(name).first.wait_for(timeout=60_000)
    page.get_by_text("strategy.name").first.wait_for(timeout=30_000)
    assistant = page.locator("button[aria-label='Close']").last  # MLflow's assistant side bar, when it shows
    if assistant.count():
        assistant.click()
    page.set_viewport_size({"width": 1400, "height": 1900})  # the parameters and metrics tables below the plot
    page.wait_for_timeout(1500)  # the charts settle
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "tracking-compare.png"), full_page=True)
    if os.environ.get("WORKBENCH_DOCS_SCREENSHOTS") == "1":
        shutil.copyfile(ARTIFACTS / "tracking-compare.png", ROOT / "docs" / "_static" / "tracking-compare.png")
