"""Every benchmark script still speaks the workbench's API: all of them import in one process (their module-level
code runs, as under ``python bench/<script>.py``), their ``main`` not run. A rename the scripts missed fails here,
not on the day someone measures."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

IMPORT_EACH = """
import importlib.util, sys
sys.path.insert(0, sys.argv[1])
for path in sys.argv[2:]:
    name = "bench_" + path.rsplit("/", 1)[1][:-3]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    print("imported", path, flush=True)
"""


def _bench(module: str):
    """A module of ``bench/``, imported by its plain name (as the scripts import each other)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(str(BENCH))


def test_every_benchmark_script_imports():
    scripts = sorted(str(p) for p in BENCH.glob("*.py"))
    done = subprocess.run([sys.executable, "-c", IMPORT_EACH, str(BENCH), *scripts], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{done.stdout[-1000:]}\n{done.stderr[-3000:]}"
    assert done.stdout.count("imported ") == len(scripts) > 10


def test_time_to_accuracy_judges_as_keras_computes_and_keeps_judging_off_the_clock():
    """The bench's NumPy judge gives Keras's logits for both workloads; its clock leaves the evaluations out."""
    import numpy as np

    workloads = _bench("tta_workloads")
    WORKLOADS, arrays, keras_model = workloads.WORKLOADS, workloads.arrays, workloads.keras_model
    predict, time_to_target = workloads.predict, workloads.time_to_target
    for workload in WORKLOADS:
        model = keras_model(workload, 0.5)
        x, _ = arrays(workload, "test")
        assert np.allclose(predict(workload, model.get_weights(), x[:50]), model(x[:50]).numpy(), atol=1e-4), workload
    record = {"call": 10.0, "first": 11.0, "evals": [[12.0, 0.5, 0.3], [13.0, 0.8, 0.2], [14.0, 0.96, 0.4]]}
    assert time_to_target(record, 0.95) == pytest.approx(
        {"from_call": 3.5, "from_first": 2.5, "epochs": 3, "accuracy": 0.96, "epoch_seconds": 0.75})  # 0.7 and 0.8
    assert time_to_target(record, 0.75)["epoch_seconds"] == pytest.approx(0.7)
    assert time_to_target(record, 0.45)["epoch_seconds"] is None  # one judgement: no epoch between two
    missed = time_to_target(record, 0.99)
    assert missed["from_call"] is None and missed["epochs"] == 3 and missed["accuracy"] == 0.96


def test_time_to_accuracy_judges_on_one_blas_thread_with_the_weights_fetch_off_the_clock():
    """An all-reduce job's callbacks' model fetches its weights when ``callback.model`` is read: the judge reads it
    inside the judged seconds; and judges on one BLAS thread (OpenBLAS's spinning threads would take a core from the
    steps after it)."""
    import time

    from threadpoolctl import threadpool_info

    from workbench.compat.keras import watch_model_reads

    workloads = _bench("tta_workloads")
    model = workloads.keras_model("mlp", 0.5)
    seen = {}

    def fetch():  # what the all-reduce mirror does on a read: a round trip to worker 0
        time.sleep(0.2)
        seen["blas_threads"] = [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]

    clock = workloads.TargetClock("mlp", 0.99)
    callback = clock.keras_callback()
    callback.set_model(model)
    watch_model_reads(callback, fetch)
    callback.on_epoch_end(0)
    (_when, accuracy, seconds), = clock.evals
    assert seconds >= 0.2 and 0.0 <= accuracy < 0.99
    assert seen["blas_threads"] and set(seen["blas_threads"]) == {1}


def test_time_to_accuracy_pools_staleness_and_times_an_epoch_over_every_repeat():
    summarize = _bench("time_to_accuracy").summarize
    run = {"from_call": 1.0, "from_first": 0.5, "epochs": 7, "accuracy": 0.97, "error": None, "epoch_seconds": 0.05}
    raw = {"mlp": {"async-ps": [{**run, "staleness": [0] * 80 + [1] * 10 + [2] * 9 + [10]},
                                {**run, "staleness": [1] * 100}],
                   "sync-ps k=0": [{**run, "staleness": None}], "first_job": {},
                   "pss": [{**run, "epoch_seconds": 0.06}, {**run, "epoch_seconds": 0.08}, {**run, "epoch_seconds": None}]}}
    rows = summarize(raw)["mlp"]
    assert rows["async-ps"]["staleness"] == {"mean": 0.69, "p90": 1, "p99": 2, "max": 10, "steps": 200}
    assert "staleness" not in rows["sync-ps k=0"]
    # each side's time an epoch: the median of its runs' (a failed run has none), and the baseline's over it
    assert rows["pss"]["epoch_seconds"] == pytest.approx(0.07)
    assert rows["async-ps"]["epoch_baseline_over_workbench"] == pytest.approx(1.4)
    assert "epoch_baseline_over_workbench" not in rows["sync-ps k=0"]  # its baseline was not run


def test_time_to_accuracy_sets_each_repeats_estimate_against_its_own_run():
    """``--estimate`` profiles a side right after each of its runs (the machine's speed drifts within minutes): the
    summary is the median of the repeats' predicted / measured, with their spread; a run that missed the target
    (an infinite time) has no ratio."""
    summarize = _bench("time_to_accuracy").summarize

    def run(from_call, predicted):
        ratio = predicted / from_call if from_call else float("nan")
        return {"from_call": from_call, "from_first": from_call, "epochs": 7, "accuracy": 0.97, "error": None,
                "epoch_seconds": 0.05, "estimate": {"setup_seconds": 0.3, "step_seconds": 0.01, "from_call": predicted,
                                                    "over_measured": ratio}}

    raw = {"cnn": {"async-ps": [run(2.0, 1.6), run(1.0, 1.1), run(4.0, 4.0), run(None, 1.2)], "first_job": {},
                   "local": [{"from_call": 1.0, "from_first": 0.5, "epochs": 6, "accuracy": 0.97, "error": None,
                              "epoch_seconds": 0.1}]}}
    rows = summarize(raw)["cnn"]
    guess = rows["async-ps"]["estimate"]
    assert guess["over_measured"] == pytest.approx(1.0)  # of 0.8, 1.1 and 1.0
    assert (guess["over_measured_min"], guess["over_measured_max"]) == (pytest.approx(0.8), pytest.approx(1.1))
    assert guess["from_call"] == pytest.approx(1.4) and guess["step_seconds"] == pytest.approx(0.01)
    assert "estimate" not in rows["local"]


def test_syncreplicas_other_clients_wait_while_the_chief_judges(tmp_path):
    """With backup workers the other SyncReplicas clients would train on during the chief's judging (off the clock):
    they wait between their steps from the moment the chief asks until it is done; a client that never answers
    fails the run within the bound instead of hanging it."""
    import threading
    import time

    baselines = _bench("tta_baselines")
    BaselineError, PausedPeers = baselines.BaselineError, baselines.PausedPeers
    chief, other = PausedPeers(str(tmp_path / "pause"), 2), PausedPeers(str(tmp_path / "pause"), 2)
    steps: list[float] = []
    stop = threading.Event()

    def client() -> None:  # the other client's loop: a step is a short sleep
        while not stop.is_set() and len(steps) < 100_000:
            other.wait_while_paused(1)
            steps.append(time.monotonic())
            time.sleep(0.001)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while len(steps) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        with chief.paused(True):
            judged = time.monotonic()
            time.sleep(0.2)  # the judging: no step of the other client starts meanwhile
            done = len(steps)
        assert [t for t in steps[:done] if t > judged] == []
        deadline = time.monotonic() + 30
        while len(steps) == done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(steps) > done, "the other client did not go on once the judging ended"
        with chief.paused(False):  # k = 0: nothing to ask
            assert not (tmp_path / "pause").exists()
    finally:
        stop.set()
        thread.join(10)
    chief.LIMIT = 0.2
    with pytest.raises(BaselineError, match="every other SyncReplicas client to pause"):
        with chief.paused(True):
            pass
    assert not (tmp_path / "pause").exists()  # asked no longer: a client started later does not wait


def test_time_to_accuracy_on_gpus_checks_where_the_steps_ran_and_says_what_it_runs():
    """``--gpu``: the GPU sides by default (all-reduce, async-ps, the ps strategies in bf16, one process), results in
    a file of their own, ``--workers`` only with it; a run whose workers stepped on a CPU is a failed run."""
    tta = _bench("time_to_accuracy")
    args = tta.parse_args(["--gpu"])
    assert args.sides.split(",") == list(tta.GPU_SIDES) and args.json.name == "time_to_accuracy_gpu.json"
    assert all(side in tta.KNOWN_SIDES for side in tta.GPU_SIDES)
    assert tta.parse_args([]).json.name == "time_to_accuracy.json"
    with pytest.raises(SystemExit):
        tta.parse_args(["--workers", "2"])
    gpus = ["/job:worker/replica:0/task:0/device:GPU:0", "/job:worker/replica:0/task:1/device:GPU:0"]
    assert tta.off_the_gpus(gpus) is None
    assert "task:1/device:CPU:0" in tta.off_the_gpus([gpus[0], "/job:worker/replica:0/task:1/device:CPU:0"])
    assert "no device" in tta.off_the_gpus([])


def test_time_to_accuracy_on_gpus_says_why_it_skips_on_a_machine_without_any(tmp_path):
    from workbench.cluster.machine.gpus import discover_gpus

    if discover_gpus():
        pytest.skip("this machine has NVIDIA GPUs: there the command trains for many minutes (make bench-gpu runs it)")
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, str(BENCH / "time_to_accuracy.py"), "--gpu", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--gpu skipped: no NVIDIA GPU" in done.stdout
    assert "no NVIDIA GPU" in json.loads(out.read_text())["skipped"]
