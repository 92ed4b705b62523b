"""wb.train(..., strategy=wb.AsyncPS(transfer=...)): parameters and gradients travel in 16 or 8 bits and the model still learns."""

import keras
import pytest
from training_helpers import LOSS

import workbench as wb
from workbench.errors import ConfigurationError

pytestmark = pytest.mark.cluster


def mlp():
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])


PARAMETERS = 64 * 64 + 64 + 64 * 10 + 10  # the model's weights: 4810


def trained(cluster, transfer, strategy=wb.AsyncPS):
    job = wb.train(cluster, mlp, wb.datasets.digits, LOSS, keras.optimizers.Adam(3e-3), strategy=strategy(transfer=transfer),
                   steps=600, batch_size=64, seed=1, metrics=["accuracy"], telemetry=False)
    job.wait(300)
    assert job.state == "finished", f"transfer={transfer}: the job ended {job.state}: {job.error}"
    return job


@pytest.mark.parametrize("transfer, width", [("fp32", 4), ("bf16", 2), ("fp16", 2), ("int8", 1)])
def test_each_precision_learns_the_digits_and_moves_fewer_bytes(cluster, transfer, width):
    job = trained(cluster, transfer)
    accuracy = job.evaluate(wb.datasets.digits_test)["accuracy"]
    assert accuracy >= 0.90, f"transfer={transfer}: test accuracy {accuracy:.3f}"
    scales = 4 * 4 if transfer == "int8" else 0  # one float32 scale per variable travels with the values
    assert job.info["transfer"] == transfer
    assert job.info["bytes_per_step"] == {"parameters": PARAMETERS * width + scales,
                                          "gradients": PARAMETERS * width + scales,
                                          "total": 2 * (PARAMETERS * width + scales)}


def test_int8_keeps_what_rounding_lost_on_each_worker(cluster):
    seen = {}

    class ErrorFeedback(keras.callbacks.Callback):
        """At the end of training (before the job lets go of them): each worker's error-feedback variables."""

        def on_train_end(self, logs=None):
            for device, variables in job.trainer.fns.packing._residuals.items():
                seen[device] = [(v.device, float(abs(v).numpy().max())) for v in variables]

    job = wb.train(cluster, mlp, wb.datasets.digits, LOSS, keras.optimizers.Adam(3e-3), steps=200, batch_size=64, seed=1,
                   strategy=wb.AsyncPS(transfer="int8"), telemetry=False, callbacks=[ErrorFeedback()])
    job.wait(300)
    assert job.state == "finished", job.error
    assert set(seen) == {f"/job:worker/replica:0/task:{i}/device:CPU:0" for i in range(2)}
    for device, variables in seen.items():
        for where, largest in variables:
            assert where == device, f"the error feedback of {device} lives on {where}"
            assert largest > 0, "nothing was carried over from rounding"
    assert not job.trainer.fns.packing._residuals  # let go of once the job ended


@pytest.mark.parametrize("transfer", ["bf16", "int8"])
def test_sync_ps_with_reduced_precision_learns_too(cluster, transfer):
    accuracy = trained(cluster, transfer, strategy=wb.SyncPS).evaluate(wb.datasets.digits_test)["accuracy"]
    assert accuracy >= 0.90, f"sync-ps, transfer={transfer}: test accuracy {accuracy:.3f}"


def test_bad_transfer_options_say_what_to_use(cluster):
    with pytest.raises(ConfigurationError, match="transfer='fp8' is not a precision: use one of 'fp32', 'bf16', 'fp16', 'int8'"):
        wb.SyncPS(transfer="fp8")
    with pytest.raises(TypeError, match="transfer"):  # all-reduce moves no parameters between ps and workers
        wb.AllReduce(transfer="bf16")
    with pytest.raises(TypeError, match=r"transfer= is now strategy=wb.AsyncPS\(transfer=...\)"):
        wb.train(cluster, mlp, wb.datasets.digits, LOSS, transfer="bf16")
