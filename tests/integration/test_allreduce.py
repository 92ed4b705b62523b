"""strategy="allreduce": MultiWorkerMirroredStrategy on the worker engines, driven from the kernel."""

import subprocess
import sys

import heap_probe
import numpy as np
import pytest
from sshd import free_port
from training_helpers import make_model, train

import workbench as wb
from workbench.telemetry import StepSpan

pytestmark = pytest.mark.cluster


def test_allreduce_learns_digits_with_every_worker_in_every_step(cluster):
    cursor = cluster.telemetry.cursor
    job = train(cluster, strategy=wb.AllReduce(steps_per_call=25), steps=300).wait(600)
    assert job.state == "finished"
    history = job.history
    assert [r["step"] for r in history] == list(range(300))
    assert all(r["worker"] == "worker:0,worker:1" and r["aggregated"] == 2 and r["examples"] == 64 for r in history)
    assert {type(v) for r in history for v in r.values()} <= {int, float, str}  # plain numbers, as in the ps strategies
    assert history[-1]["loss"] < history[0]["loss"] / 5
    assert job.info["replicas"] == 2 and job.info["per_worker_batch_size"] == 32
    # the steps' device is where the strategy put each worker's replica, as the engine reports it (here its CPU;
    # a GPU worker's GPU: bench/gpu.py fails a strategy whose steps ran off the GPUs by this record)
    events = [e for e in cluster.telemetry.since(cursor).events if isinstance(e, StepSpan) and e.job == job.name]
    assert {(e.task, e.device) for e in events} == {(w, cluster.task(w).task.device + "/device:CPU:0") for w in ("worker:0", "worker:1")}
    # a step ends once its update is applied, not once its loss exists: the MLP's forward and backward take tens of
    # microseconds, the gradients' all-reduce between two processes about a millisecond, and the timeline shows that
    phase = {name: np.median([e.duration for e in events if e.phase == name and e.step > 0]) for name in ("compute", "allreduce+apply")}
    assert phase["allreduce+apply"] > phase["compute"], phase
    result = job.evaluate(wb.datasets.digits_test)
    assert result["examples"] == 450 and result["accuracy"] >= 0.90, result
    # the local copy holds the same weights as the engines
    x, y = wb.datasets.digits_arrays("test")
    accuracy = float(np.mean(np.argmax(job.model.predict(x, verbose=0), axis=1) == y))
    assert accuracy == pytest.approx(result["accuracy"], abs=1e-6)
    import tensorflow as tf

    batched = job.evaluate(tf.data.Dataset.from_tensor_slices((x, y)).batch(64))  # as Keras users pass it
    assert batched["examples"] == 450 and batched["accuracy"] == pytest.approx(result["accuracy"], abs=1e-6)


def test_allreduce_follows_the_same_loss_curve_as_sync_ps(cluster):
    # Same seed and global batch: both average the two workers' gradients of the same data split, so
    # both follow the single-worker curve (tests/integration/test_training_faults.py checks sync-ps
    # with 1 vs 2 workers). Sums in another order differ in the last bits; Adam carries that on.
    allreduce = train(cluster, strategy=wb.AllReduce(steps_per_call=20), steps=60).wait(300)
    sync = train(cluster, strategy="sync-ps", steps=60).wait(300)
    np.testing.assert_allclose([r["loss"] for r in allreduce.history], [r["loss"] for r in sync.history], rtol=1e-3, atol=1e-4)


def test_allreduce_resumes_from_its_checkpoints(cluster, tmp_path):
    first = train(cluster, strategy=wb.AllReduce(steps_per_call=25), checkpoint=wb.Checkpoint(tmp_path, every=50), steps=100).wait(300)
    assert sorted(int(p.name[5:-6]) for p in tmp_path.glob("ckpt-*.index")) == [50, 100]
    assert first.last_checkpoint.endswith("ckpt-100")
    second = train(cluster, strategy=wb.AllReduce(steps_per_call=25), checkpoint=wb.Checkpoint(tmp_path, resume=True), steps=150).wait(300)
    assert second.start_step == 100
    assert [r["step"] for r in second.history] == list(range(100, 150))
    assert np.mean([r["loss"] for r in second.history[:10]]) < np.mean([r["loss"] for r in first.history[:10]]) / 3


def test_allreduce_checkpoints_hold_the_weights_of_their_step_though_calls_go_out_ahead(cluster, tmp_path):
    # Within an epoch each call is sent while the one before runs, except after a call that a checkpoint follows:
    # the checkpoint of step 20 holds what a job of 20 steps ends with, not what the next call trained since.
    import tensorflow as tf

    train(cluster, strategy=wb.AllReduce(steps_per_call=5), checkpoint=wb.Checkpoint(tmp_path, every=10), steps=30).wait(300)
    shorter = train(cluster, strategy=wb.AllReduce(steps_per_call=5), steps=20).wait(300)
    model = make_model()
    tf.train.Checkpoint(model=model).restore(str(tmp_path / "ckpt-20")).expect_partial().assert_existing_objects_matched()
    for saved, trained in zip(model.get_weights(), shorter.model.get_weights(), strict=True):
        np.testing.assert_allclose(saved, trained, rtol=1e-6, atol=1e-7)


def test_allreduce_sends_short_calls_several_to_a_request_and_hooks_every_call(cluster):
    # Calls of two steps of the MLP last milliseconds: the calls of an epoch go to the workers several in one request
    # (an engine's turnaround between two requests was a tenth of the MLP's steps), and Keras's batch hooks still
    # come once per call, in order, with the call's newest step.
    import keras

    class BatchEnds(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batches = []

        def on_train_batch_end(self, batch, logs=None):
            self.batches.append(batch)

    ends = BatchEnds()
    sent = len(cluster.client.history)
    job = train(cluster, strategy=wb.AllReduce(steps_per_call=2), steps=200, steps_per_epoch=100, callbacks=[ends]).wait(300)
    requests = len(cluster.client.history) - sent  # everything this kernel sent the engines, set-up included
    assert job.state == "finished" and [r["step"] for r in job.history] == list(range(200))
    assert ends.batches == [*range(1, 100, 2)] * 2
    assert requests < 100, f"{requests} requests for 100 calls on each of 2 workers"


def test_a_later_allreduce_job_of_the_program_trains_the_workers_step_function_again_from_its_own_start(cluster):
    # A cell run again, a sweep over seeds: the workers take the variables and step function the program's last job
    # made (tracing it was most of a short job's set-up), set to the new job's initial values. Another program (here a
    # wider model) builds its own.
    from workbench.training.strategies.allreduce import engine as allreduce_engine

    def wider():
        import keras

        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(48, activation="relu"), keras.layers.Dense(10)])

    other = train(cluster, model=wider, strategy=wb.AllReduce(steps_per_call=10), steps=40).wait(300)
    first = train(cluster, strategy=wb.AllReduce(steps_per_call=10), steps=60).wait(300)
    again = train(cluster, strategy=wb.AllReduce(steps_per_call=10), steps=60).wait(300)
    assert other.state == first.state == again.state == "finished"
    assert not first.info["reused_step_function"] and again.info["reused_step_function"]
    # the same seed, the same run: the values set into the kept variables are those the strategy made for the first
    np.testing.assert_allclose([r["loss"] for r in again.history], [r["loss"] for r in first.history], rtol=1e-5, atol=1e-6)
    reseeded = train(cluster, strategy=wb.AllReduce(steps_per_call=10), steps=60, seed=8).wait(300)
    assert reseeded.info["reused_step_function"] and reseeded.history[0]["loss"] != first.history[0]["loss"]
    import keras

    slower = train(cluster, strategy=wb.AllReduce(steps_per_call=10), steps=60, optimizer=keras.optimizers.Adam(0.001)).wait(300)
    assert slower.info["reused_step_function"]  # a sweep over learning rates: the rate is a variable, set per job
    assert slower.history[0]["loss"] == pytest.approx(first.history[0]["loss"], rel=1e-5)  # the same start
    assert slower.history[-1]["loss"] > first.history[-1]["loss"]  # a tenth of the rate: slower down
    # unseeded, every worker starts from the same values all the same (the kernel draws the job's): they stay equal
    unseeded = train(cluster, strategy=wb.AllReduce(steps_per_call=10), steps=60, seed=None).wait(300)
    assert unseeded.info["reused_step_function"] and unseeded.history[-1]["loss"] < unseeded.history[0]["loss"]
    engines = [cluster.task(w).engine_id for w in ("worker:0", "worker:1")]
    weights = [cluster.client[e].apply_sync(allreduce_engine.weights, unseeded.trainer.run_id) for e in engines]
    for mine, theirs in zip(*weights, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-7)
    result = unseeded.evaluate(wb.datasets.digits_test)
    assert result["examples"] == 450 and result["accuracy"] > 0.5, result


def test_allreduce_runs_notebook_style_functions_the_engines_cannot_import(cluster):
    # Functions from a module the engines do not have (like this test module) travel by value.
    def tiny_data(ctx):
        import tensorflow as tf

        x = tf.random.stateless_uniform([256, 8], seed=[ctx.seed, 0])
        return tf.data.Dataset.from_tensor_slices((x, tf.reduce_sum(x, axis=1, keepdims=True)))

    def tiny_model():
        import keras

        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])

    job = wb.train(cluster, tiny_model, tiny_data, "mse", "sgd", strategy="allreduce", steps=20, batch_size=16,
                   metrics=["mae"]).wait(300)
    assert len(job.history) == 20 and "mae" in job.history[0]


def test_allreduce_workers_keep_no_graph_of_the_jobs_that_ended(cluster):
    # TensorFlow registers a gradient function, process-wide and for good, for each all-reduce it traces (a custom
    # gradient), and that function holds the step's graph: each job's would stay on every worker for the engine's life.
    count = ("import gc; from tensorflow.python.framework.func_graph import FuncGraph; gc.collect(); "
             "graphs_alive = sum(isinstance(o, FuncGraph) for o in gc.get_objects())")  # the traced graphs Python holds
    workers = cluster.client[[r.engine_id for r in cluster.tasks if r.job == "worker"]]
    alive = []
    for _ in range(3):
        train(cluster, strategy=wb.AllReduce(steps_per_call=10), steps=20).wait(300)
        workers.execute(count, block=True)  # after the job's clean-up there (an engine runs what it is sent in order)
        alive.append(workers.pull("graphs_alive", block=True))
    assert alive[0] == alive[1] == alive[2], alive


GENERATOR_PROBE = heap_probe.CODE + """
import tensorflow as tf
before = refaults()
next(iter(tf.data.Dataset.from_generator(lambda: iter([1]), output_signature=tf.TensorSpec([], tf.int32))))
print(before, refaults())
"""


def test_tensorflows_generator_dataset_makes_every_large_block_a_mapping_of_its_own():
    # What the workers undo as they join their group (``machine.memory.keep_large_blocks_in_heap``). Should this fail,
    # TensorFlow no longer fixes glibc's mmap threshold, and the undoing can go.
    done = subprocess.run([sys.executable, "-c", GENERATOR_PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = (int(n) for n in done.stdout.split()[-2:])
    assert before < heap_probe.MAPPED_PAGES / 4, before  # glibc's default: the freed block reused
    assert after > 0.9 * heap_probe.MAPPED_PAGES, after


# a worker engine's side of an SPMD cell, alone in a fresh Python (an all-reduce group of one): the cell's own
# distributed input is its process's first generator dataset
SPMD_PROBE = heap_probe.CODE + """
import sys
import tensorflow as tf
from workbench.training.strategies.allreduce import engine
assert engine.join_group([f"127.0.0.1:{sys.argv[-1]}"], 0, ["solo"])["ok"]
strategy = engine.spmd_names()["strategy"]
batches = iter(strategy.experimental_distribute_dataset(tf.data.Dataset.range(64).batch(8)))
print(int(strategy.reduce("SUM", strategy.run(tf.reduce_sum, (next(batches),)), axis=None)), refaults())
"""


def test_an_spmd_cells_own_distributed_input_leaves_large_blocks_in_the_heap():
    done = subprocess.run([sys.executable, "-c", SPMD_PROBE, str(free_port())], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    total, refaults = (int(n) for n in done.stdout.split()[-2:])
    assert total == sum(range(8))  # the cell's first batch, all-reduced
    assert refaults < heap_probe.MAPPED_PAGES / 4, refaults


def test_after_an_allreduce_job_its_workers_heaps_keep_large_blocks_again(cluster):
    # Each replica's input is a generator dataset: without the undoing, every tensor over 128 KiB of a later job on
    # these engines (a CNN's sync-ps steps: 1.4 times as long) would be mapped, faulted in and unmapped every time.
    train(cluster, strategy=wb.AllReduce(steps_per_call=10), steps=20).wait(300)
    workers = cluster.client[[r.engine_id for r in cluster.tasks if r.job == "worker"]]
    workers.execute(heap_probe.CODE + "\nheap_refaults = refaults()", block=True)
    refaults = workers.pull("heap_refaults", block=True)
    assert all(n < heap_probe.MAPPED_PAGES / 4 for n in refaults), refaults
