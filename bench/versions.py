"""The same benchmark on two versions of the workbench, side by side in one run: is a change free?

A refactoring that should change nothing users measure is checked here: ``--before REV`` (a commit) is
checked out into a temporary git worktree beside this one, and the chosen benchmark runs in turn in
the two checkouts, each with its own package (``PYTHONPATH``; the engines inherit it) and its own
copy of the benchmark script (each version speaks its own API), in the order before, after, after,
before, ... so that drift of the shared machine falls on both sides. Each run is a fresh process with
a fresh cluster. It prints the median steps/s of every line on each side and the ratio after / before,
with the per-round ratios; the raw figures go to ``bench/results/versions-<bench>.json``.

    python bench/versions.py --before 4425afb training [--rounds 2] [--lines async-ps,sync-ps-k0,...]
    python bench/versions.py --before 4425afb network [--rounds 2]        # the precision part
    python bench/versions.py --before 4425afb tta [--rounds 2] [--sides "async-ps,sync-ps k=0"] [--workloads mlp,cnn]

``training``: ``bench/training.py --repeats 1`` on the workbench's lines (default: async-ps, sync-ps with
k = 0 and 1, allreduce; steady-state steps/s). ``network``: ``bench/network.py --part precision --repeats 1``
(fp32 with and without overlapped reads, bf16 and int8 behind emulated 1 Gbit/s links; steps/s). ``tta``:
``bench/time_to_accuracy.py --repeats N`` on the workbench's sides (seconds to the held-out target from the call and
from the first call, and a side's time an epoch, each run's medians: there a ratio after / before below 1 is the
faster).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIM = Path("workbench/cluster/process/workbench-bind-shim.so")  # a build output: each checkout needs its own copy
RUN_SECONDS = 3600  # one run of a benchmark, at most


def checkout(rev: str, into: Path) -> Path:
    """A worktree of ``rev`` in ``into``, with this checkout's built bind shim (same C source since it was made)."""
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(into), rev], cwd=ROOT, check=True, timeout=120)
    if (ROOT / SHIM).exists():
        shutil.copy2(ROOT / SHIM, into / SHIM)
    return into


def run_training(tree: Path, args, out: Path) -> dict[str, float]:
    command = [sys.executable, "bench/training.py", "--repeats", "1", "--lines", args.lines, "--json", str(out)]
    run(tree, command)
    medians = json.loads(out.read_text())["medians"]
    return {line: medians[line]["steps_per_s"] for line in args.lines.split(",") if line in medians}


def run_network(tree: Path, args, out: Path) -> dict[str, float]:
    run(tree, [sys.executable, "bench/network.py", "--part", "precision", "--repeats", "1"])
    lines = json.loads((tree / "bench" / "results" / "network.json").read_text())["precision"]["lines"]
    return {setting: line["steps_per_s"] for setting, line in lines.items()}


def run_tta(tree: Path, args, out: Path) -> dict[str, float]:
    run(tree, [sys.executable, "bench/time_to_accuracy.py", "--repeats", str(args.tta_repeats), "--sides", args.sides,
               "--workloads", args.workloads, "--json", str(out)])
    summary = json.loads(out.read_text())["summary"]
    figures = {f"{case} {side} {clock}": row[key]["median"] for case, rows in summary.items() for side, row in rows.items()
               for key, clock in (("from_call", "call"), ("from_first", "first"))}
    # an epoch's time on the clock: what a change to the steps' machinery moves, without the draw of the epochs
    figures.update({f"{case} {side} epoch ms": 1000 * row["epoch_seconds"] for case, rows in summary.items()
                    for side, row in rows.items() if row.get("epoch_seconds")})
    return figures


UNITS = {"training": "steps/s", "network": "steps/s", "tta": "seconds to the target"}


def run(tree: Path, command: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree)}  # this version's package, in the script and in every engine
    print(f"  [{tree.name}] {' '.join(command[1:])}", flush=True)
    done = subprocess.run(command, cwd=tree, env=env, timeout=RUN_SECONDS, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed in {tree} (exit {done.returncode}):\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench", choices=tuple(UNITS))
    parser.add_argument("--before", required=True, help="the commit to compare this checkout with")
    parser.add_argument("--rounds", type=int, default=2, help="runs on each side (before, after, after, before, ...)")
    parser.add_argument("--lines", default="async-ps,sync-ps-k0,sync-ps-k1,allreduce", help="training's lines")
    parser.add_argument("--sides", default="async-ps,sync-ps k=0", help="tta's sides")
    parser.add_argument("--workloads", default="mlp,cnn", help="tta's workloads")
    parser.add_argument("--tta-repeats", type=int, default=3, help="tta's repeats within each run")
    args = parser.parse_args()
    measure = {"training": run_training, "network": run_network, "tta": run_tta}[args.bench]
    scratch = Path(tempfile.mkdtemp(prefix="workbench-versions-"))
    figures: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    before = checkout(args.before, scratch / "before")
    try:
        trees = {"before": before, "after": ROOT}
        for round_ in range(args.rounds):
            for side in ("before", "after") if round_ % 2 == 0 else ("after", "before"):
                found = measure(trees[side], args, scratch / f"{side}-{round_}.json")
                figures[side].append(found)
                print(f"round {round_ + 1} {side}: " + ", ".join(f"{k} {v:.2f}" for k, v in found.items()), flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, timeout=120)
        shutil.rmtree(scratch, ignore_errors=True)
    report = compare(figures)
    print(f"\n{args.bench}: {UNITS[args.bench]}, medians of {args.rounds} run(s) a side; after = this checkout, "
          f"before = {args.before}")
    for line, r in report.items():
        rounds = ", ".join(f"{x:.2f}" for x in r["per_round"])
        print(f"  {line:24s} before {r['before']:7.2f}  after {r['after']:7.2f}  after/before {r['ratio']:.2f} "
              f"(per round {rounds})")
    out = ROOT / "bench" / "results" / f"versions-{args.bench}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"before": args.before, "figures": figures, "report": report}, indent=2))
    print(f"written: {out}")
    return 0


def compare(figures: dict[str, list[dict[str, float]]]) -> dict[str, dict]:
    """Medians of each line on each side, their ratio, and the ratio within each round."""
    lines = [line for line in figures["after"][0] if all(line in f for side in figures.values() for f in side)]
    return {line: {"before": statistics.median(f[line] for f in figures["before"]),
                   "after": statistics.median(f[line] for f in figures["after"]),
                   "ratio": statistics.median(f[line] for f in figures["after"])
                   / statistics.median(f[line] for f in figures["before"]),
                   "per_round": [a[line] / b[line] for a, b in zip(figures["after"], figures["before"])]}
            for line in lines}


if __name__ == "__main__":
    sys.exit(main())
