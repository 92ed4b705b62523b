"""Peak memory of each tutorial, as Binder would count it: a Jupyter server, the kernel, and all it starts.

Binder gives a session a fixed memory limit (mybinder.org: 1 GB guaranteed, at most 2 GB). Each
notebook runs top to bottom in a fresh kernel of this environment, beside an idle JupyterLab server
(started once, as Binder runs one), while a sampler sums the proportional set size (PSS: shared pages
split between the processes that map them, the closest per-process figure to what a container's
memory limit counts) over the server and the kernel's whole process tree every 0.25 s.

At each tutorial's peak it reports the total, the share of each kind of process (server, kernel,
warm process, controller, engines, nannies), and each engine's mean PSS and USS (USS: pages no other
process shares, what one more engine adds).

    python bench/tutorial_memory.py [--only 03] [--json bench/results/tutorial_memory.json]
    make bench-memory

Goals: every tutorial's peak <= 1.5 GiB with the server, and per-engine USS <= 80 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import nbformat
import psutil
from jupyter_client import KernelManager
from nbclient import NotebookClient

from workbench.cluster.machine.memory import GiB, MiB

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
GOAL_PEAK = 1.5 * GiB
GOAL_ENGINE_USS = 80 * MiB
_KINDS = (("workbench.cluster.launch.engine_main", "engine"), ("ipyparallel.engine.nanny", "nanny"),
          ("workbench.cluster.launch.warm", "warm"), ("ipyparallel.controller", "controller"), ("ipykernel", "kernel"),
          ("jupyter-lab", "server"), ("jupyter_lab", "server"), ("jupyterlab", "server"))


def _kind(process: psutil.Process) -> str:
    command = " ".join(process.cmdline())
    for marker, kind in _KINDS:
        if marker in command:
            return kind
    return "other"


def tree_memory(roots: list[psutil.Process]) -> list[tuple[str, int, int]]:
    """(kind, PSS, USS) in bytes of each root and each of its descendants still running."""
    processes: dict[int, psutil.Process] = {}
    for root in roots:
        try:
            for process in (root, *root.children(recursive=True)):
                processes[process.pid] = process
        except psutil.Error:
            continue
    rows = []
    for process in processes.values():
        try:
            info = process.memory_full_info()
            rows.append((_kind(process), info.pss, info.uss))
        except psutil.Error:  # exited between the listing and the reading
            pass
    return rows


class IdleJupyter:
    """A JupyterLab server on 127.0.0.1 that nobody uses: what a Binder session runs beside the kernel."""

    def __init__(self, timeout: float = 120.0):
        self._runtime = tempfile.mkdtemp(prefix="wb-bench-runtime-")
        env = {**os.environ, "JUPYTER_RUNTIME_DIR": self._runtime}
        command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", "--ServerApp.port=0",
                   "--IdentityProvider.token=bench", f"--ServerApp.root_dir={NOTEBOOKS}"]
        if os.geteuid() == 0:
            command.append("--allow-root")
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout
        while not any(Path(self._runtime).glob("jpserver-*.json")):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("JupyterLab did not start (run `jupyter lab` by hand to see why)")
            time.sleep(0.2)
        time.sleep(2.0)  # settle: the server finishes loading its extensions after writing its file

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=20)


def run_notebook(path: Path, server: psutil.Process | None, interval: float = 0.25) -> dict:
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
                roots = [psutil.Process(pid), *([server] if server else [])]
            except psutil.Error:
                continue
            rows = tree_memory(roots)
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
    by_kind: dict[str, int] = defaultdict(int)
    for kind, pss, _ in peak:
        by_kind[kind] += pss
    engines = [(pss, uss) for kind, pss, uss in peak if kind == "engine"]
    return {"notebook": path.name, "peak_mib": round(sum(pss for _, pss, _ in peak) / MiB),
            "processes_at_peak": len(peak), "engines_at_peak": len(engines),
            "pss_by_kind_mib": {kind: round(value / MiB) for kind, value in sorted(by_kind.items())},
            "engine_pss_mib": round(statistics.mean(p for p, _ in engines) / MiB) if engines else None,
            "engine_uss_mib": round(statistics.mean(u for _, u in engines) / MiB) if engines else None,
            "engine_uss_max_mib": round(max(u for _, u in engines) / MiB) if engines else None,
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run the notebooks whose name starts with this, e.g. 03")
    parser.add_argument("--no-server", action="store_true", help="leave the idle JupyterLab server out")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]-*.ipynb"))
    if args.only:
        paths = [p for p in paths if p.name.startswith(args.only)]
    if not paths:
        sys.exit(f"no tutorial matches --only {args.only!r} in {NOTEBOOKS}")
    jupyter = None if args.no_server else IdleJupyter()
    results = []
    try:
        server = psutil.Process(jupyter.process.pid) if jupyter else None
        for path in paths:
            result = run_notebook(path, server)
            results.append(result)
            kinds = ", ".join(f"{kind} {mib}" for kind, mib in result["pss_by_kind_mib"].items())
            print(f"{result['notebook']:32s} peak {result['peak_mib']:5d} MiB PSS over {result['processes_at_peak']:2d} "
                  f"processes ({kinds}); {result['engines_at_peak']} engine(s), each {result['engine_pss_mib']} MiB PSS / "
                  f"{result['engine_uss_mib']} MiB USS (max {result['engine_uss_max_mib']}) ({result['seconds']:.0f} s)",
                  flush=True)
    finally:
        if jupyter:
            jupyter.stop()
    worst = max(results, key=lambda r: r["peak_mib"])
    worst_uss = max((r["engine_uss_max_mib"] or 0) for r in results)
    print(f"\nhighest peak: {worst['peak_mib']} MiB ({worst['notebook']}; goal <= {GOAL_PEAK / MiB:.0f} MiB"
          f"{' with the Jupyter server' if jupyter else ''}); largest engine USS {worst_uss} MiB (goal <= "
          f"{GOAL_ENGINE_USS / MiB:.0f} MiB)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
