"""What a GPU machine must show: one GPU per worker engine, and training on the workers' GPUs.

For each worker count N (1, 2, 4, ... and the last, up to ``--max-workers``, default every GPU ``discover_gpus()``
lists), one ``wb.Cluster(ps=1, workers=N, gpus_per_worker=1)``:

- placement: on every engine, its pid, ``CUDA_VISIBLE_DEVICES``, the GPUs TensorFlow lists there and the PCI bus
  id of each GPU CUDA shows it. Goal: worker i sees exactly one GPU, the i-th one listed (its bus id is
  ``nvidia-smi``'s for that id: the engines run with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so CUDA numbers GPUs as
  ``nvidia-smi`` does), no GPU is shown to two engines, and the ps sees none;
- training: ``wb.train`` with each strategy (``--strategies``: async-ps, sync-ps, allreduce) on a ResNet
  (``--model``: ``resnet50`` or ``resnet101`` from ``keras.applications``, or ``resnet10``, one basic block per
  stage) at ``--image-size`` (128) with 1000 classes, synthetic images (64 random ones per worker, repeated),
  ``--per-worker-batch`` (64), SGD with momentum, ``--steps`` steps. Images/s: bench/training.py's steady-state
  rate of the job's history (20%-90% of its steps) times the images a step consumes; scaling: images/s at N
  over images/s at 1 worker; the devices the workers' steps ran on: the job's telemetry. Goal: every strategy
  computes on the GPUs. A job still running after bench/training.py's ``TIMEOUT`` (900 s) is stopped and failed.
- reference: the same model, per-worker batch, data and optimizer in one process on the first GPU, stepped by a
  ``tf.function``; each strategy's images/s at 1 worker over it (what distributing costs on one GPU).

Where there is nothing to measure (no NVIDIA GPU, TensorFlow not importable, or a TensorFlow that lists no GPU,
e.g. the CPU-only build) it says which in one line, writes ``{"skipped": reason}`` and exits 0. Otherwise it
exits 1 when a check fails, a run fails, or a strategy's steps ran off the GPUs.

    python bench/gpu.py [--model resnet50] [--image-size 128] [--per-worker-batch 64] [--steps 50] [--max-workers N]
                        [--strategies async-ps,sync-ps,allreduce] [--json bench/results/gpu.json]

A quick check: ``python bench/gpu.py --model resnet10 --image-size 64 --steps 30``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

from training import TIMEOUT, completion_points, finished, steady_rate

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
CLASSES = 1000
POOL = 64  # distinct random images per worker: the input pipeline stays far cheaper than a step
INSTALL = "pip install 'jupyter-tf-workbench[gpu]' (in this checkout: .venv/bin/pip install -e '.[gpu,notebook]')"
TF_PROBE = ("import json, tensorflow as tf; print(json.dumps({'version': tf.__version__, 'cuda': tf.test.is_built_with_cuda(), "
            "'gpus': [d.name for d in tf.config.list_physical_devices('GPU')]}))")


def skip_reason(gpus: list[str]) -> str | None:
    """Why this machine cannot show anything, or None. TensorFlow is imported in a child process only:
    once imported here it would fix this process's CUDA_VISIBLE_DEVICES."""
    if not gpus:
        return ("no NVIDIA GPU: nvidia-smi and /proc/driver/nvidia list none (or CUDA_VISIBLE_DEVICES hides them all); "
                "run this on a machine with NVIDIA GPUs and their driver")
    try:
        probe = subprocess.run([sys.executable, "-c", TF_PROBE], capture_output=True, text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired:
        return "TensorFlow did not list its GPUs within 300 s: check the NVIDIA driver (nvidia-smi) and try again"
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return f"TensorFlow is not importable ({last}): {INSTALL}"
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    if not seen["gpus"]:
        if not seen["cuda"]:
            return f"TensorFlow {seen['version']} is a CPU-only build (tensorflow-cpu): pip uninstall tensorflow-cpu, then {INSTALL}"
        return (f"TensorFlow {seen['version']} (built with CUDA) lists no GPU although the driver has {len(gpus)}: "
                "check that the CUDA libraries of tensorflow[and-cuda] load (TensorFlow's log says which does not)")
    return None


def gpu_machine() -> tuple[list[str], str | None]:
    """This machine's NVIDIA GPUs (``discover_gpus``), and why nothing can train on them (None: something can)."""
    from workbench.cluster.machine.gpus import discover_gpus

    gpus = discover_gpus()
    return gpus, skip_reason(gpus)


def engine_view() -> dict:
    """Runs on an engine (shipped by ipyparallel, so it imports what it needs): what this process sees."""
    import ctypes
    import os

    import tensorflow as tf

    bus_ids = []
    try:  # CUDA's own view of this process's GPUs (CUDA_VISIBLE_DEVICES applied), by PCI bus id
        cuda, count = ctypes.CDLL("libcuda.so.1"), ctypes.c_int()
        if cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0:
            for i in range(count.value):
                device, bus = ctypes.c_int(), ctypes.create_string_buffer(32)
                if cuda.cuDeviceGet(ctypes.byref(device), i) == 0 and cuda.cuDeviceGetPCIBusId(bus, 32, device) == 0:
                    bus_ids.append(bus.value.decode())
    except OSError:
        pass  # no driver library: only TensorFlow's list is reported
    return {"pid": os.getpid(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "tf_gpus": [d.name for d in tf.config.list_physical_devices("GPU")], "bus_ids": bus_ids}


def bus_id(text: str) -> str:
    """``00000000:3B:00.0`` (nvidia-smi) and ``0000:3b:00.0`` (CUDA) -> one spelling."""
    domain, _, rest = text.strip().partition(":")
    return f"{int(domain, 16):04x}:{rest.lower()}"


def smi_bus_ids() -> dict[str, str]:
    """GPU index and UUID -> PCI bus id, as nvidia-smi lists them (empty without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    ids = {}
    for line in out.splitlines():
        index, uuid, bus = (part.strip() for part in line.split(","))
        ids[index] = ids[uuid] = bus_id(bus)
    return ids


def placement(cluster, gpus: list[str], smi: dict[str, str]) -> list[dict]:
    """One row per task: what its engine sees, what it should see, and whether the two agree."""
    rows = []
    for record in cluster.tasks:
        seen = cluster.client[record.engine_id].apply_async(engine_view).get(timeout=120)
        expected = [gpus[record.index]] if record.job == "worker" else []
        expected_bus = [smi.get(g) for g in expected]
        ok = (len(seen["tf_gpus"]) == len(expected) and record.gpus == expected
              and (seen["cuda_visible_devices"] or "") == ",".join(expected)
              and (None in expected_bus or [bus_id(b) for b in seen["bus_ids"]] == expected_bus))
        rows.append({"task": record.name, **seen, "assigned": expected, "expected_bus_ids": expected_bus, "ok": ok})
    buses = [bus for row in rows for bus in row["bus_ids"]]  # no GPU shown to two engines
    return [dict(row, ok=row["ok"] and len(set(buses)) == len(buses)) for row in rows]


def resnet10(size: int, classes: int):
    """A small ResNet: a stem, then one basic block (two 3x3 convolutions and a shortcut) per stage."""
    import keras
    from keras import layers

    inputs = keras.Input((size, size, 3))
    x = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(64, 7, strides=2, padding="same", use_bias=False)(inputs)))
    for stage, filters in enumerate((64, 128, 256, 512)):
        stride = 1 if stage == 0 else 2
        shortcut = x if stride == 1 else layers.BatchNormalization()(layers.Conv2D(filters, 1, strides=stride, use_bias=False)(x))
        y = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)))
        y = layers.BatchNormalization()(layers.Conv2D(filters, 3, padding="same", use_bias=False)(y))
        x = layers.ReLU()(layers.Add()([shortcut, y]))
    return keras.Model(inputs, layers.Dense(classes)(layers.GlobalAveragePooling2D()(x)), name="resnet10")


def model_function(name: str, size: int):
    def make_model():
        import keras

        if name == "resnet10":
            return resnet10(size, CLASSES)
        application = {"resnet50": keras.applications.ResNet50, "resnet101": keras.applications.ResNet101}[name]
        return application(weights=None, input_shape=(size, size, 3), classes=CLASSES, classifier_activation=None)

    return make_model


def synthetic_images(size: int):
    def data(ctx):
        import tensorflow as tf

        seed = [ctx.seed, ctx.worker_index]
        images = tf.random.stateless_uniform([POOL, size, size, 3], seed=seed)
        labels = tf.random.stateless_uniform([POOL], seed=seed, maxval=CLASSES, dtype=tf.int32)
        return tf.data.Dataset.from_tensor_slices((images, labels))

    return data


def train_line(cluster, args: argparse.Namespace, strategy: str, workers: int) -> dict:
    """One job; images/s in steady state and the devices its workers' steps ran on."""
    import keras

    import workbench as wb

    cursor = cluster.telemetry.cursor
    job = wb.train(cluster, model_function(args.model, args.image_size), synthetic_images(args.image_size),
                   keras.losses.SparseCategoricalCrossentropy(from_logits=True), keras.optimizers.SGD(0.01, momentum=0.9),
                   strategy=strategy, steps=args.steps, batch_size=args.per_worker_batch * workers, seed=0)
    history = finished(job).history  # waited for at most TIMEOUT s (then stopped)
    per_step = sum(r["examples"] for r in history) / len(history)
    rate = steady_rate(completion_points(history))
    devices = step_devices(cluster, cursor, job.name)
    return {"steps_per_s": rate, "images_per_s": rate * per_step, "images_per_step": per_step,
            "devices": devices, "on_gpu": on_gpus(devices)}


def step_devices(cluster, cursor, job_name: str) -> list[str]:
    """The devices job ``job_name``'s workers ran their steps on (the cluster's telemetry since ``cursor``)."""
    from workbench.telemetry import StepSpan

    return sorted({e.device for e in cluster.telemetry.since(cursor).events
                   if isinstance(e, StepSpan) and e.job == job_name and e.task.startswith("worker")})


def on_gpus(devices: list[str]) -> bool:
    """Whether the workers' steps ran on GPUs only (``step_devices``)."""
    return bool(devices) and all("/device:GPU:" in d for d in devices)


def local_run(args: argparse.Namespace) -> dict:
    """The reference the jobs are read against: the same model, per-worker batch, data and optimizer in one process,
    stepped by a ``tf.function`` (TensorFlow's custom training loop), on the one GPU this process sees. Images/s over
    ``--steps`` timed steps after 10 warm-up steps; runs in a child process (``local_line``)."""
    import time

    import keras
    import tensorflow as tf

    model = model_function(args.model, args.image_size)()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    batches = iter(synthetic_images(args.image_size)(argparse.Namespace(seed=0, worker_index=0))
                   .repeat().batch(args.per_worker_batch).prefetch(tf.data.AUTOTUNE))

    @tf.function
    def step(images, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    for _ in range(10):
        step(*next(batches)).numpy()
    started = time.perf_counter()
    for _ in range(args.steps):
        loss = step(*next(batches))
    loss.numpy()
    seconds = time.perf_counter() - started
    return {"images_per_s": args.steps * args.per_worker_batch / seconds, "steps_per_s": args.steps / seconds,
            "device": [d.name for d in tf.config.list_logical_devices("GPU")]}


def local_line(args: argparse.Namespace, gpu: str) -> dict:
    """``local_run`` in a child process that sees only ``gpu`` (this process has TensorFlow loaded already)."""
    command = [sys.executable, __file__, "--local-run", "--model", args.model, "--image-size", str(args.image_size),
               "--per-worker-batch", str(args.per_worker_batch), "--steps", str(args.steps)]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu, CUDA_DEVICE_ORDER="PCI_BUS_ID")
    try:
        child = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=env, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"the one-process run did not finish within {TIMEOUT} s"}
    if child.returncode != 0:  # TensorFlow's last line names the op; the line before it the error
        lines = child.stderr.strip().splitlines() or ["no output"]
        return {"error": next((line for line in reversed(lines) if "Error" in line), lines[-1]).strip()}
    return json.loads(child.stdout.strip().splitlines()[-1])


def worker_counts(most: int) -> list[int]:
    """1, 2, 4, ... and ``most``."""
    return sorted({min(2**k, most) for k in range(most.bit_length() + 1)})


def print_placement(n: int, rows: list[dict]) -> None:
    print(f"\n{n} worker(s): {'task':9s} {'pid':>8s}  {'CUDA_VISIBLE_DEVICES':20s}  {'TensorFlow GPUs':32s}  PCI bus ids")
    for row in rows:
        visible = row["cuda_visible_devices"] or repr(row["cuda_visible_devices"])  # '' hides every GPU; None: unset
        print(f"{'':13s}{row['task']:9s} {row['pid']:8d}  {visible:20s}  "
              f"{','.join(row['tf_gpus']) or '-':32s}  {','.join(row['bus_ids']) or '-'}{'' if row['ok'] else '  WRONG'}")


def scaling(runs: dict[str, dict[str, dict]]) -> dict[str, dict[str, float]]:
    """Images/s at N workers over images/s at 1, per strategy, where both runs succeeded."""
    return {strategy: {n: run["images_per_s"] / by_n["1"]["images_per_s"] for n, run in by_n.items()
                       if "images_per_s" in run and "images_per_s" in by_n.get("1", {})} for strategy, by_n in runs.items()}


def print_scaling(runs: dict[str, dict[str, dict]], ratios: dict[str, dict[str, float]], counts: list[int]) -> None:
    print(f"\n{'images/s (scaling vs 1 worker)':30s}" + "".join(f"{f'{n} worker(s)':>20s}" for n in counts))
    for strategy, by_n in runs.items():
        cells = ["failed" if "images_per_s" not in by_n[str(n)] else f"{by_n[str(n)]['images_per_s']:.0f}"
                 + (f" ({ratios[strategy][str(n)]:.2f}x)" if str(n) in ratios[strategy] else "") for n in counts]
        print(f"{strategy:30s}" + "".join(f"{cell:>20s}" for cell in cells))


def write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"written: {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("resnet50", "resnet101", "resnet10"), default="resnet50")
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--per-worker-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--max-workers", type=int, default=None, help="default: one worker per GPU")
    parser.add_argument("--strategies", default="async-ps,sync-ps,allreduce")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "gpu.json")
    parser.add_argument("--local-run", action="store_true", help=argparse.SUPPRESS)  # the child of local_line
    args = parser.parse_args()
    if args.local_run:
        print(json.dumps(local_run(args)))
        return 0
    if args.max_workers is not None and args.max_workers < 1:
        parser.error("--max-workers must be 1 or more")
    strategies = args.strategies.split(",")
    if set(strategies) - {"async-ps", "sync-ps", "allreduce"}:
        parser.error(f"--strategies {args.strategies!r}: choose from async-ps, sync-ps, allreduce")

    gpus, reason = gpu_machine()
    if reason:
        print(f"bench/gpu.py skipped: {reason}")
        write(args.json, {"skipped": reason})
        return 0

    import workbench as wb

    counts = worker_counts(min(args.max_workers or len(gpus), len(gpus)))
    smi = smi_bus_ids()
    result: dict = {"gpus": gpus, "nvidia_smi_bus_ids": smi, "model": args.model, "image_size": args.image_size,
                    "classes": CLASSES, "per_worker_batch": args.per_worker_batch, "steps": args.steps,
                    "timeout_s": TIMEOUT, "estimator": "steady-state rate between 20% and 90% of each run's steps (bench/training.py)",
                    "placement": {}, "runs": {s: {} for s in strategies}}
    failed = []
    for n in counts:
        with wb.Cluster(ps=1, workers=n, gpus_per_worker=1, env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, progress=False) as cluster:
            rows = result["placement"][str(n)] = placement(cluster, gpus, smi)
            print_placement(n, rows)
            failed += [f"placement {n}: {row['task']}" for row in rows if not row["ok"]]
            for strategy in strategies:
                try:
                    run = train_line(cluster, args, strategy, n)
                    print(f"{strategy:9s} {n} worker(s): {run['images_per_s']:8.1f} images/s ({run['steps_per_s']:.2f} steps/s) "
                          f"on {', '.join(run['devices'])}{'' if run['on_gpu'] else '  NOT on the GPUs'}", flush=True)
                    if not run["on_gpu"]:
                        failed.append(f"{strategy} {n}: steps ran on {run['devices']}")
                except Exception as exc:  # noqa: BLE001 - one failed run is reported; the others still run
                    run = {"error": f"{type(exc).__name__}: {exc}"}
                    print(f"{strategy:9s} {n} worker(s): FAILED {run['error'][:2000]}", flush=True)
                    failed.append(f"{strategy} {n}: {run['error'][:200]}")
                result["runs"][strategy][str(n)] = run
            gc.collect()  # the jobs' remote resources are freed while their tasks still run, not at exit
    result["scaling"] = scaling(result["runs"])
    print_scaling(result["runs"], result["scaling"], counts)
    local = result["local"] = local_line(args, gpus[0])
    if "error" in local:
        print(f"one process, one GPU: FAILED {local['error']}")
        failed.append(f"one-process run: {local['error'][:200]}")
    else:
        result["per_local"] = {s: by_n["1"]["images_per_s"] / local["images_per_s"]
                               for s, by_n in result["runs"].items() if "images_per_s" in by_n.get("1", {})}
        print(f"one process, one GPU (tf.function steps): {local['images_per_s']:.0f} images/s; 1 worker over it: "
              + ", ".join(f"{s} {r:.2f}" for s, r in result["per_local"].items()))
    result["failed"] = failed
    write(args.json, result)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
