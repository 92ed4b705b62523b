"""Beyond one machine: start time per launcher, and one async-ps job on 1 host vs 3 emulated hosts.

Start time: ``wb.Cluster(ps=1, workers=2, engines=...).start()`` until every TensorFlow server is up,
for ``local`` (engines forked from a warm process), ``mpi`` (Open MPI's mpiexec), ``ssh`` (an sshd on
a loopback port; one command per host, which imports TensorFlow once and forks that host's engines),
``ssh-each`` (the same with every engine a process of its own) and ``slurm`` (a single-node Slurm,
sbatch + srun), in alternating order, medians over the repeats. The daemons come from the test
suite's fixtures (``tests/sshd.py``, ``tests/slurm.py``, ``tests/hosts.py``), which install what is
missing when run as root.

Hosts: three emulated hosts (network namespaces on a bridge, an sshd each). The same async-ps job
(bench/training.py's model, data and steady-state estimator; per-worker batch 32, 10 steps per call)
runs on a cluster whose three tasks share one host, then on one spread over the three (one task per
host, so parameters and gradients cross the bridge), alternating, medians over the repeats.

On this 2-core machine, all the hosts share the same two cores: the ratio says what the bridge and
the hosts' separate network stacks cost, not what more machines would buy.

    python bench/launchers.py [--repeats 3] [--steps 2000] [--json bench/results/launchers.json]

Needs root for mpi/ssh/slurm installs, the hosts and Slurm; launchers that cannot run are reported
with the reason and left out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import debian  # noqa: E402
import hosts  # noqa: E402
import slurm  # noqa: E402
import sshd  # noqa: E402
from training import workbench_run  # noqa: E402

from workbench.cluster.launch.engine_main import FORKS_ENV  # noqa: E402

PER_WORKER_BATCH = 32
STEPS_PER_CALL = 10


def _launchers(stack) -> tuple[dict[str, dict], dict[str, str]]:
    """Options per launcher that can run here, and why the others cannot."""
    options: dict[str, dict] = {"local": {}}
    skipped: dict[str, str] = {}
    reason = debian.ensure(["mpiexec"], ["openmpi-bin"], "Open MPI")
    if reason:
        skipped["mpi"] = reason
    else:
        options["mpi"] = {}
    reason = sshd.available()
    if reason:
        skipped["ssh"] = reason
    else:
        server = stack(sshd.LocalSSHD())
        options["ssh"] = dict(hosts={f"127.0.0.1:{server.port}": 3}, ssh_args=server.ssh_args, scp_args=server.ssh_args,
                              remote_python=sys.executable, remote_profile_dir=str(server.dir / "profile"))
        # the same, with each engine a process of its own that imports TensorFlow (before per-host forks)
        options["ssh-each"] = {**options["ssh"], "env": {FORKS_ENV: "1"}}
    reason = slurm.available()
    if reason:
        skipped["slurm"] = reason
    else:
        cluster = stack(slurm.LocalSlurm(cpus=16))
        os.environ.update(cluster.env)  # sbatch, squeue and scancel find it
        options["slurm"] = {}
    return options, skipped


def start_seconds(name: str, options: dict) -> float:
    import workbench as wb

    engines = name.split("-")[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        started = time.perf_counter()
        cluster = wb.Cluster(ps=1, workers=2, engines=engines, controller_ip="127.0.0.1", progress=False,
                             start_timeout=180, name=f"wb-bench-{name}", **options).start()
        seconds = time.perf_counter() - started
    cluster.stop()
    return seconds


def hosts_run(emulated, spread: bool, steps: int) -> dict:
    import workbench as wb

    layout = {h.ssh_host: 1 for h in emulated.hosts} if spread else {emulated.hosts[0].ssh_host: 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cluster = wb.Cluster(ps=1, workers=2, engines="ssh", hosts=layout, controller_ip=emulated.head,
                             ssh_args=emulated.ssh_args, scp_args=emulated.ssh_args, remote_python=sys.executable,
                             remote_profile_dir=str(emulated.hosts[0].sshd.dir / "profile"), progress=False,
                             start_timeout=180, name="wb-bench-hosts").start()
    try:
        before = emulated.bridge_bytes()
        run = workbench_run(cluster, strategy="async-ps", steps=steps, batch=PER_WORKER_BATCH * 2,
                            steps_per_call=STEPS_PER_CALL)
        return {"examples_per_s": run.examples_per_s, "steps_per_s": run.steps_per_s,
                "bridge_bytes_per_step": (emulated.bridge_bytes() - before) / steps,
                "hosts": sorted({t.host for t in cluster.tasks})}
    finally:
        cluster.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "launchers.json")
    args = parser.parse_args()
    opened: list = []

    def stack(thing):
        opened.append(thing)
        return thing

    result: dict = {"repeats": args.repeats, "steps": args.steps}
    try:
        options, skipped = _launchers(stack)
        starts: dict[str, list[float]] = {name: [] for name in options}
        for repeat in range(args.repeats):
            order = list(options) if repeat % 2 == 0 else list(reversed(options))
            for name in order:
                starts[name].append(start_seconds(name, options[name]))
                print(f"start {name:6s} repeat {repeat + 1}: {starts[name][-1]:.1f} s", flush=True)
        result["start_seconds"] = {name: {"median": statistics.median(v), "runs": v} for name, v in starts.items()}
        result["skipped"] = skipped
        reason = hosts.available()
        if reason:
            result["hosts"] = {"skipped": reason}
        else:
            emulated = stack(hosts.EmulatedHosts(3))
            runs: dict[str, list[dict]] = {"1 host": [], "3 hosts": []}
            for repeat in range(args.repeats):
                for spread in ((False, True) if repeat % 2 == 0 else (True, False)):
                    label = "3 hosts" if spread else "1 host"
                    runs[label].append(hosts_run(emulated, spread, args.steps))
                    print(f"{label:7s} repeat {repeat + 1}: {runs[label][-1]['examples_per_s']:.0f} examples/s", flush=True)
            medians = {label: statistics.median(r["examples_per_s"] for r in rs) for label, rs in runs.items()}
            result["hosts"] = {"examples_per_s": medians, "ratio_3_to_1": medians["3 hosts"] / medians["1 host"],
                               "runs": runs}
    finally:
        for thing in reversed(opened):
            thing.close()
    print(f"\nstart time, 1 ps + 2 workers (median of {args.repeats}):")
    for name, figures in result.get("start_seconds", {}).items():
        print(f"  {name:6s} {figures['median']:.1f} s  (runs: {', '.join(f'{s:.1f}' for s in figures['runs'])})")
    for name, why in result.get("skipped", {}).items():
        print(f"  {name:6s} not measured: {why}")
    if "ratio_3_to_1" in result.get("hosts", {}):
        h = result["hosts"]
        print(f"async-ps examples/s: 1 host {h['examples_per_s']['1 host']:.0f}, 3 hosts {h['examples_per_s']['3 hosts']:.0f}, "
              f"ratio 3/1 {h['ratio_3_to_1']:.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
