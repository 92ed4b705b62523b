"""Peak memory of each tutorial: the kernel and everything it starts (controller, engines, nannies).

Binder gives a session a fixed memory limit (mybinder.org: 1 GB guaranteed, at most 2 GB), and every
TensorFlow process costs several hundred MB, so the tutorials' cluster sizes are a memory question.
Each notebook runs top to bottom in a fresh kernel of this environment while a sampler sums the
proportional set size (PSS: shared library pages split between the processes that map them, the
closest per-process figure to what a container's memory limit counts) over the kernel's process
tree every 0.25 s. The Jupyter server itself (about 100-150 MB) is not included.

Also printed, at each peak: the kernel's PSS and each engine's mean PSS and USS (USS: pages no
other process shares, what one more engine adds).

    python bench/tutorial_memory.py [--only 03] [--json bench/results/tutorial_memory.json]
    make bench-memory
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import nbformat
import psutil
from jupyter_client import KernelManager
from nbclient import NotebookClient

from workbench.cluster.memory import MiB

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _kind(process: psutil.Process) -> str:
    command = " ".join(process.cmdline())
    for marker, kind in (("workbench.cluster.engine_main", "engine"), ("ipyparallel.engine.nanny", "nanny"),
                         ("ipykernel", "kernel")):
        if marker in command:
            return kind
    return "other"


def tree_memory(root: psutil.Process) -> list[tuple[str, int, int]]:
    """(kind, PSS, USS) in bytes of ``root`` and each of its descendants still running."""
    try:
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return []
    rows = []
    for process in processes:
        try:
            info = process.memory_full_info()
            rows.append((_kind(process), info.pss, info.uss))
        except psutil.Error:  # exited between the listing and the reading
            pass
    return rows


def run_notebook(path: Path, interval: float = 0.25) -> dict:
    notebook = nbformat.read(path, as_version=4)
    manager = KernelManager(kernel_name="python3")
    client = NotebookClient(notebook, km=manager, timeout=600, resources={"metadata": {"path": str(NOTEBOOKS)}})
    peak: list[tuple[str, int, int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(interval):
            pid = getattr(manager.provisioner, "pid", None) if manager.has_kernel else None
            if pid is None:
                continue
            try:
                rows = tree_memory(psutil.Process(pid))
            except psutil.Error:
                continue
            if sum(pss for _, pss, _ in rows) > sum(pss for _, pss, _ in peak):
                peak[:] = rows

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    try:
        client.execute()
    finally:
        done.set()
        sampler.join(5)
        if manager.has_kernel:
            manager.shutdown_kernel(now=False)
    engines = [(pss, uss) for kind, pss, uss in peak if kind == "engine"]
    return {"notebook": path.name, "peak_mib": round(sum(pss for _, pss, _ in peak) / MiB),
            "processes_at_peak": len(peak), "engines_at_peak": len(engines),
            "engine_pss_mib": round(statistics.mean(p for p, _ in engines) / MiB) if engines else None,
            "engine_uss_mib": round(statistics.mean(u for _, u in engines) / MiB) if engines else None,
            "kernel_pss_mib": round(sum(pss for kind, pss, _ in peak if kind == "kernel") / MiB),
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run the notebooks whose name starts with this, e.g. 03")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]-*.ipynb"))
    if args.only:
        paths = [p for p in paths if p.name.startswith(args.only)]
    if not paths:
        sys.exit(f"no tutorial matches --only {args.only!r} in {NOTEBOOKS}")
    results = []
    for path in paths:
        result = run_notebook(path)
        results.append(result)
        print(f"{result['notebook']:32s} peak {result['peak_mib']:5d} MiB PSS over {result['processes_at_peak']:2d} "
              f"processes; kernel {result['kernel_pss_mib']} MiB; {result['engines_at_peak']} engine(s), each "
              f"{result['engine_pss_mib']} MiB PSS / {result['engine_uss_mib']} MiB USS ({result['seconds']:.0f} s)",
              flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
